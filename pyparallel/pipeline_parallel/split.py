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

**Analysis.** B finds the intermediates and groups for every micro-batch, on the graph its forward just
recorded (a cache across micro-batches would silently drop gradients the day a forward took another path).
``pyparallel._C.split_plan`` (csrc/autograd/split_plan.cpp) walks the C++ graph and installs the capture
pre-hooks in C++, making a Python object only for the intermediates; :func:`_analyse` and Python pre-hooks
are the same computation without the extension, and the tests hold the two equal.

**Direct W.** Each backward call costs the engine a walk over every node it can reach (most of the
micro-batch's graph for the upper layers) plus Python's entry: ~0.1-0.3 ms per group, about a fifth of
W's time for a GPT chunk on a CPU core (``benchmarks/split_backward.py``). The groups that are one node
computing one layer's weight gradients — a Linear's ``AddmmBackward0`` / ``MmBackward0`` (through
``TBackward0``), a ``NativeLayerNormBackward0`` — skip the engine: W evaluates that node's own formula
for its weight outputs from its saved tensors (the same ATen calls, in the same operand order, as
autograd's generated code for those outputs) and hands each result to the parameter's ``AccumulateGrad``
node, which accumulates and fires post-accumulate hooks as in a backward. A parameter with a tensor hook
(``register_hook``: the engine runs it) and every other node kind go through the engine. Hooks registered
on the ``AccumulateGrad`` node itself (torch DDP's reducer) are not seen by the direct path; pyparallel's
own engines use post-accumulate hooks.

Because W accumulates through autograd's own ``AccumulateGrad`` nodes, ``.grad`` is written exactly as by
a full backward (the first gradient stolen — copied on the direct path, which holds a reference to it —
and later ones added in place into an existing ``.grad``, such as a view of a flat DP buffer) and
``register_post_accumulate_grad_hook`` hooks fire once per parameter per (chunk, micro-batch). Each value
W computes comes from the same node, inputs and saved tensors as in the full backward, so gradients are
bit-identical to 1F1B's. One difference remains: W is several autograd
calls (one per group) and direct accumulations outside any autograd call, so autograd's "end of the
backward" (``Variable._execution_engine.queue_callback``) fires several times during one W, and cannot even
be asked for from a hook the direct path fires (torch raises outside a backward). A hook that must act once
when all of a micro-batch's weight gradients are in (ZeRO-2 ending its reduction round) asks this module's
:func:`queue_callback` first: while a W runs, the callback runs once, when that W has finished.

When the input needs no gradient (the first stage's token ids), B is empty and W is the whole backward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

# While a WeightPass runs: the callbacks to run once it has finished (``queue_callback``); None otherwise.
# A plain global, not thread-local: on CUDA autograd runs the hooks on its device threads.
_pass_callbacks: list | None = None
# While the pipeline runs one chunk's backward or W (``running``): that chunk, and, for a W run ahead of its
# place in the action list (an early W), the callbacks to run when the schedule reaches that place.
_chunk: int | None = None
_in_place: list | None = None


def queue_callback(fn) -> bool:
    """Run ``fn()`` once when the W now running has finished (all its autograd calls and direct
    accumulations), as autograd's ``queue_callback`` does at the end of a backward; False when no W is
    running (the caller then falls back on autograd's own, inside a backward)."""
    if _pass_callbacks is None:
        return False
    _pass_callbacks.append(fn)
    return True


@contextmanager
def running(chunk: int, early: bool = False):
    """The pipeline runs chunk ``chunk``'s backward or W inside this (``running_chunk``). ``early``: a W run
    ahead of its place in the action list; yields the list of what :func:`queue_in_place` asked for, which
    the pipeline runs when it reaches that place (None when not early)."""
    global _chunk, _in_place
    outer = _chunk, _in_place
    _chunk, _in_place = chunk, ([] if early else None)
    try:
        yield _in_place
    finally:
        _chunk, _in_place = outer


def running_chunk() -> int | None:
    """The chunk whose backward or W runs now (None outside the pipeline's ``running``)."""
    return _chunk


def queue_in_place(fn) -> bool:
    """Run ``fn()`` when the schedule reaches the place in the action list of the W now running ahead of it
    (an early W, which runs when the stage would otherwise wait for a message, so at a point that differs
    between data-parallel replicas); False when no early W is running (the caller then acts now: it is at
    its place). ZeRO-2 issues a round's reduce-scatters there, so that every replica issues them at the
    same point of the same list (``zero.engine``)."""
    if _in_place is None:
        return False
    _in_place.append(fn)
    return True


@dataclass
class _Group:
    intermediates: list = field(default_factory=list)  # autograd Nodes
    params: list = field(default_factory=list)  # parameters (tensors)
    direct: tuple | None = None  # (formula, AccumulateGrad nodes by output) when W may skip the engine


def _leaf(fn, param_nodes: dict, transposes: int):
    """The AccumulateGrad node ``fn`` is, or reaches through exactly ``transposes`` lone TBackward0 nodes."""
    for _ in range(transposes):
        if fn is None or fn.name() != "TBackward0" or len(fn.next_functions) != 1:
            return None
        fn = fn.next_functions[0][0]
    return fn if fn in param_nodes else None


def _mm_weight_grad(grad, mat1, sizes, strides):
    """The gradient of ``mat2`` in ``mat1 @ mat2`` as autograd computes it (``mm_mat2_backward``): for a
    column-major ``mat2`` (a Linear's ``weight.t()``) ``(grad^T mat1)^T``, else ``mat1^T grad``."""
    if strides[0] == 1 and strides[1] == sizes[0]:
        return grad.t().mm(mat1).t()
    return mat1.t().mm(grad)


def _addmm(node, grad, accs):
    weight, bias = accs
    out = []
    if weight is not None:
        mat1 = node._saved_mat1
        if mat1.layout != torch.strided:  # autograd has another formula for sparse operands
            return None
        dw = _mm_weight_grad(grad, mat1, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides)
        out.append((weight, dw.t()))  # the TBackward0 between the node and the weight
    if bias is not None:  # the engine sums a broadcast input's gradient to its shape (sum_to)
        out.append((bias, grad.sum_to_size(bias.variable.shape)))
    return out


def _mm(node, grad, accs):
    mat1 = node._saved_self
    if mat1.layout != torch.strided:
        return None
    return [(accs[0], _mm_weight_grad(grad, mat1, node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides).t())]


def _layer_norm(node, grad, accs):
    weight, bias = accs
    _, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad, node._saved_input, node._saved_normalized_shape, node._saved_result1, node._saved_result2,
        node._saved_weight, node._saved_bias, [False, weight is not None, bias is not None])
    return [(a, g) for a, g in ((weight, dw), (bias, db)) if a is not None]


def _direct_formula(node, params: list, param_nodes: dict):
    """``(formula, accs)`` when ``node`` alone computes the gradients of exactly ``params`` by a formula
    above (module doc, "Direct W"), else None. Checked once per B, on the recorded graph."""
    name, nxt = node.name(), [fn for fn, _ in node.next_functions]
    if name == "AddmmBackward0" and len(nxt) == 3 and node._saved_alpha == 1 and node._saved_beta == 1:
        formula, accs = _addmm, (_leaf(nxt[2], param_nodes, 1), _leaf(nxt[0], param_nodes, 0))
    elif name == "MmBackward0" and len(nxt) == 2:
        formula, accs = _mm, (_leaf(nxt[1], param_nodes, 1),)
    elif name == "NativeLayerNormBackward0" and len(nxt) == 3:
        formula, accs = _layer_norm, (_leaf(nxt[1], param_nodes, 0), _leaf(nxt[2], param_nodes, 0))
    else:
        return None
    found = [param_nodes[a] for a in accs if a is not None]
    if len(found) != len(params) or any(all(q is not t for t in found) for q in params):
        return None  # some parameter it reaches is not one of this node's weight inputs
    if any(q.dtype.is_complex or q.layout != torch.strided for q in found):
        return None
    return formula, accs


class WeightPass:
    """The deferred W of one (chunk, micro-batch): ``run()`` accumulates the weight gradients."""

    def __init__(self, groups: list[_Group] | None, captured: dict | None, full: tuple | None = None):
        self._groups, self._captured, self._full = groups, captured, full

    @property
    def num_groups(self) -> int:
        return len(self._groups) if self._groups is not None else 1

    @property
    def num_direct(self) -> int:
        """Groups whose W may skip the engine (module doc, "Direct W")."""
        return sum(g.direct is not None for g in self._groups) if self._groups is not None else 0

    def run(self) -> None:
        """Accumulate the weight gradients, then run what hooks queued with :func:`queue_callback` (once,
        whether W took one autograd call, several, or none). As at the end of a failed backward, a W that
        raises drops them."""
        global _pass_callbacks
        outer, _pass_callbacks = _pass_callbacks, []
        try:
            self._accumulate()
            done = _pass_callbacks
        finally:
            _pass_callbacks = outer
        for fn in done:
            fn()

    def _accumulate(self) -> None:
        if self._full is not None:  # B was empty: W is the whole backward
            y, grad = self._full
            self._full = None
            if y.requires_grad:
                torch.autograd.backward(y, grad)
            return
        groups, captured = self._groups, self._captured
        self._groups = self._captured = None
        for g in groups:
            if g.direct is not None and _run_direct(g, captured):
                continue
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


def _run_direct(g: _Group, captured: dict) -> bool:
    """W of a one-node group without the engine (module doc, "Direct W"); False leaves it to the engine
    (a parameter has a tensor hook, the gradient does not match the parameter as the engine would cast
    it, or an operand is not a strided tensor)."""
    formula, accs = g.direct
    if any(q._backward_hooks for q in g.params):
        return False
    node = g.intermediates[0]
    saved = captured.get(node)
    if saved is None or saved[0] is None:  # no gradient reached it in B
        return True
    grad = saved[0]
    if grad.layout != torch.strided or any(grad.dtype != q.dtype or grad.device != q.device for q in g.params):
        return False
    with torch.no_grad():
        out = formula(node, grad, accs)
        if out is None:
            return False
        for acc, dg in out:
            acc(dg)
    return True


def _node_of(t: torch.Tensor):
    return get_gradient_edge(t).node


def _analyse(root, x_node, param_nodes: dict) -> list[_Group]:
    """Intermediates of the graph under ``root`` and the parameter groups they reach (module doc).

    One iterative depth-first walk puts every node after its children (post-order); one pass over that
    order then finds the nodes that reach the input, and the parameters under every node that does not.
    Nothing here is a closure over the graph: a reference cycle through the nodes would hold the
    micro-batch's saved tensors until the garbage collector ran."""
    children: dict = {}
    post, stack = [], [(root, False)]
    while stack:
        n, done = stack.pop()
        if done:
            post.append(n)
            continue
        if n in children:
            continue
        kids = [fn for fn, _ in n.next_functions if fn is not None]
        children[n] = kids
        stack.append((n, True))
        stack.extend((k, False) for k in kids if k not in children)
    to_x: set = set()  # nodes with a path to the input
    reach: dict = {}  # node off that path -> the parameter nodes under it (its whole subgraph is off it)
    for n in post:
        kids = children[n]
        if n is x_node or any(k in to_x for k in kids):
            to_x.add(n)
            continue
        under = {n} if n in param_nodes else set()
        for k in kids:
            under |= reach[k]
        reach[n] = under
    order = post[::-1]  # parents first: groups in the order a backward meets them
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
                mine |= reach[k]
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


def _set_direct(groups: list[_Group], param_nodes: dict) -> None:
    for g in groups:
        if len(g.intermediates) == 1:
            g.direct = _direct_formula(g.intermediates[0], g.params, param_nodes)


def param_nodes_of(params) -> dict:
    """``{AccumulateGrad node: parameter}`` for the parameters that require grad. Holding the nodes keeps
    them the ones every later graph of these parameters uses (a leaf keeps its accumulator only weakly), so
    a caller may compute this once for many micro-batches of the same parameters."""
    return {_node_of(q): q for q in params if q.requires_grad}


def backward_input(y: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params,
                   param_nodes: dict | None = None) -> tuple:
    """B of one (chunk, micro-batch): ``(dL/dx or None, WeightPass)``. ``y`` is the chunk's output (or
    the scaled loss, with ``grad=None``), ``x`` its input leaf, ``params`` the chunk's parameters
    (``param_nodes``: their :func:`param_nodes_of`, when the caller keeps it)."""
    if not (x.requires_grad and y.requires_grad and y.grad_fn is not None):
        return None, WeightPass(None, None, full=(y, grad))
    if param_nodes is None:
        param_nodes = param_nodes_of(params)
    native = _native()
    if native is not None:  # the same analysis and capture in C++ (module doc, "Analysis")
        plist = list(param_nodes.values())
        found, capture = native.split_plan(y, x, plist)
        groups = [_Group(list(inter), [plist[i] for i in idx]) for inter, idx in found]
        take = capture.take
    else:
        groups = _analyse(y.grad_fn, _node_of(x), param_nodes)
        take = _capture(groups)
    _set_direct(groups, param_nodes)
    try:
        (gx,) = torch.autograd.grad(y, x, grad, retain_graph=True, allow_unused=True)
    finally:
        grads = take()
    if gx is None:
        gx = torch.zeros_like(x)
    inters = (n for g in groups for n in g.intermediates)
    return gx, WeightPass(groups, {n: t for n, t in zip(inters, grads) if t is not None})


def _capture(groups: list[_Group]):
    """Python pre-hooks recording the gradient that flows into every intermediate during B; the function
    returned removes them and gives, per intermediate in group order, its gradients (None: it did not run)."""
    seen: dict = {}
    hooks = []

    def hook_for(node):
        def hook(grads):
            seen[node] = grads
        return hook

    try:
        for g in groups:
            for node in g.intermediates:
                hooks.append(node.register_prehook(hook_for(node)))
    except BaseException:
        for h in hooks:
            h.remove()
        raise

    def take() -> list:
        for h in hooks:
            h.remove()
        return [seen.get(n) for g in groups for n in g.intermediates]
    return take


def _native():
    """``pyparallel._C`` when it is built (with ``split_plan``), else None: :func:`_analyse` and
    :func:`_capture` are the same computation in Python (and its reference in the tests)."""
    from pyparallel import _ops

    return _ops._C if _ops.HAS_EXT and hasattr(_ops._C, "split_plan") else None
