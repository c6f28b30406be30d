"""The zero-bubble split of a stage's backward: B (the input gradient) now, W (the weight gradients) later.

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", arXiv:2401.10241, section 2) observe that a stage's
backward is two computations with different deadlines: the gradient with respect to the stage's *input*
(B) is what the previous stage waits for, while the gradients with respect to its *weights* (W) are only
needed by the optimizer step. Running W later fills the pipeline's bubbles with useful work.

The split here is generic — it changes no layer — and works on the autograd graph that the forward
recorded:

* **B** runs ``torch.autograd.grad(output, input, grad, retain_graph=True)``. The engine then executes
  only the nodes on a path to the input, and inside each node computes only the outputs that lead there
  (``task_should_compute_output``): a Linear's ``AddmmBackward`` computes ``dX = dY W`` and skips
  ``dW = dY^T X``. The graph's saved tensors stay alive for W.
* The nodes on the input path that also lead to a parameter outside it are the **intermediates**. A
  pre-hook captures the gradient flowing into each during B (for ``AddmmBackward``: ``dY``).
* **W** restarts autograd from those captured gradients (``GradientEdge`` roots) with ``inputs`` = the
  parameters, so the engine runs only the weight branches. Parameters are grouped by the intermediates
  that reach them (a union-find): each group is one backward call whose roots cannot reach another
  group's intermediates, so no input-gradient GEMM is recomputed. A group with several intermediates (a
  weight used twice in the chunk) clamps each intermediate to its captured gradient, so what flows into
  it from the group's other roots is not counted twice.

Because W accumulates through autograd's own ``AccumulateGrad`` nodes, ``.grad`` is written exactly as by
a full backward (first gradient stolen, later ones added in place into an existing ``.grad``, such as a
view of a flat DP buffer) and ``register_post_accumulate_grad_hook`` hooks fire once per parameter per
(chunk, micro-batch). Each value W computes comes from the same node, inputs and saved tensors as in the
full backward, so gradients are bit-identical to 1F1B's. One difference remains: W is several autograd
calls (one per group), so a hook that waits for "the end of the backward" (``queue_callback``) sees
several ends.

When the input needs no gradient (the first stage's token ids), B is empty and W is the whole backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class _Group:
    intermediates: list = field(default_factory=list)  # autograd Nodes
    params: list = field(default_factory=list)  # parameters (tensors)


class WeightPass:
    """The deferred W of one (chunk, micro-batch): ``run()`` accumulates the weight gradients."""

    def __init__(self, groups: list[_Group] | None, captured: dict | None, full: tuple | None = None):
        self._groups, self._captured, self._full = groups, captured, full

    @property
    def num_groups(self) -> int:
        return len(self._groups) if self._groups is not None else 1

    def run(self) -> None:
        if self._full is not None:  # B was empty: W is the whole backward
            y, grad = self._full
            self._full = None
            if y.requires_grad:
                torch.autograd.backward(y, grad)
            return
        groups, captured = self._groups, self._captured
        self._groups = self._captured = None
        for g in groups:
            edges, grads, hooks = [], [], []
            for node in g.intermediates:
                saved = captured.get(node)
                if saved is None:  # no gradient reached it in B (a branch that does not depend on the input)
                    continue
                for i, t in enumerate(saved):
                    if t is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(t)
                if len(g.intermediates) > 1:
                    hooks.append(node.register_prehook(lambda _grads, s=saved: s))
            try:
                if edges:
                    torch.autograd.backward(edges, grads, inputs=g.params)
            finally:
                for h in hooks:
                    h.remove()


def _node_of(t: torch.Tensor):
    return get_gradient_edge(t).node


def _params_under(n, children: dict, param_nodes: dict, reach: dict) -> set:
    """The parameter nodes reachable from ``n`` (memoised in ``reach``). A module-level function, not a
    closure: a closure that calls itself is a reference cycle, and this one would hold every node of the
    graph (``children``), and so every saved tensor of the micro-batch, until the garbage collector ran."""
    if n in reach:
        return reach[n]
    out = {n} if n in param_nodes else set()
    for k in children[n]:
        out |= _params_under(k, children, param_nodes, reach)
    reach[n] = out
    return out


def _analyse(root, x_node, param_nodes: dict) -> list[_Group]:
    """Intermediates of the graph under ``root`` and the parameter groups they reach (module doc)."""
    children: dict = {}
    order, stack = [], [root]
    while stack:  # every node reachable from root, with its children
        n = stack.pop()
        if n in children:
            continue
        kids = [fn for fn, _ in n.next_functions if fn is not None]
        children[n] = kids
        order.append(n)
        stack.extend(kids)
    # Nodes that reach the input: fixed point over a reverse topological pass (iterate until stable; the
    # graph is a DAG, so a pass in reverse discovery order converges in few rounds).
    to_x = {x_node} if x_node in children else set()
    changed = True
    while changed:
        changed = False
        for n in reversed(order):
            if n not in to_x and any(k in to_x for k in children[n]):
                to_x.add(n)
                changed = True
    # Parameters reachable from each node outside the input path (memoised DFS over the weight branches).
    reach: dict = {}
    parent: dict = {}

    def find(a):
        while parent.setdefault(a, a) is not a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    owners: dict = {}  # intermediate -> parameter nodes it reaches through a weight branch
    for n in order:
        if n not in to_x or n is x_node:
            continue
        mine = set()
        for k in children[n]:
            if k not in to_x:
                mine |= _params_under(k, children, param_nodes, reach)
        if mine:
            owners[n] = mine
            for q in mine:
                parent[find(q)] = find(n)
    groups: dict = {}
    for n, mine in owners.items():
        g = groups.setdefault(find(n), _Group())
        g.intermediates.append(n)
        for q in mine:
            if all(param_nodes[q] is not t for t in g.params):
                g.params.append(param_nodes[q])
    return list(groups.values())


def backward_input(y: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params) -> tuple:
    """B of one (chunk, micro-batch): ``(dL/dx or None, WeightPass)``. ``y`` is the chunk's output (or
    the scaled loss, with ``grad=None``), ``x`` its input leaf, ``params`` the chunk's parameters."""
    if not (x.requires_grad and y.requires_grad and y.grad_fn is not None):
        return None, WeightPass(None, None, full=(y, grad))
    param_nodes = {}
    for q in params:
        if q.requires_grad:
            param_nodes[_node_of(q)] = q
    x_node = _node_of(x)
    groups = _analyse(y.grad_fn, x_node, param_nodes)
    captured: dict = {}
    hooks = []

    def capture(node):
        def hook(grads):
            captured[node] = grads
        return hook

    try:
        for g in groups:
            for node in g.intermediates:
                hooks.append(node.register_prehook(capture(node)))
        (gx,) = torch.autograd.grad(y, x, grad, retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    if gx is None:
        gx = torch.zeros_like(x)
    return gx, WeightPass(groups, captured)
