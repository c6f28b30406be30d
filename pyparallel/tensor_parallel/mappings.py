"""The communication of tensor parallelism, as autograd functions (Megatron-LM, Shoeybi et al. 2019, §3).

Megatron's two conjugate operators:

* ``f`` = :func:`copy_to_tp`: identity in forward, all-reduce of the gradient in backward. It sits where a
  replicated activation enters column-parallel layers: each rank's layer produces only part of the
  input's gradient.
* ``g`` = :func:`reduce_from_tp`: all-reduce in forward, identity in backward. It sits where the partial
  outputs of row-parallel layers are summed back into a replicated activation.

Their gather/scatter variants along the last (feature) dimension, :func:`gather_from_tp` and
:func:`scatter_to_tp`, and the sequence-parallel variants of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", §4.2.2), which keep the activations between layers split along
the sequence dimension so that LayerNorm and dropout work on 1/t of the tokens:

* ``g`` becomes :func:`reduce_scatter_to_sequence` (reduce-scatter forward, all-gather backward);
* ``f`` becomes :func:`gather_from_sequence` (all-gather forward, reduce-scatter backward);
* :func:`scatter_to_sequence` splits a replicated activation (split forward, all-gather backward).

Every collective goes through :mod:`pyparallel.comm` on the group passed in (``mesh.tp_group``).

**Copies.** A reduction writes into its input only when nobody else can hold that buffer; the rule, in
each case:

* forward of ``g`` (``reduce_from_tp(x, owned=True)``): ``x`` is the product a row-parallel layer (or the
  vocabulary-split embedding) has just made inside its own forward: nothing but the reduction reads it,
  so it is summed in place (``ctx.mark_dirty``; should some node have saved it after all, autograd's
  version check fails loudly instead of a silent wrong gradient). A tensor a user passes in is never
  mutated: the public default clones;
* backward of ``f``: the public :func:`copy_to_tp` clones the incoming gradient. From Python one cannot see
  whether autograd handed the same gradient tensor to another node too (``a + b`` passes one tensor to
  both addends; ``y.backward(g)`` passes the caller's ``g``), so reducing it in place could corrupt a
  gradient elsewhere. The layers' private entry (:class:`SharedInput`) reduces in place: its output never
  leaves the column-parallel layers that read it, so its gradient is their own fresh input gradients
  (or autograd's sum of them), which nothing else holds.

**Sequence layout.** A [b, s, h] activation split along s: rank r's chunk is not one contiguous block
unless b = 1. Reduce-scatters write it once into the *rank-major* layout [t, b, s/t, h] (a view when
nothing precedes the sequence dimension) whose slice r is this rank's [b, s/t, h] chunk, contiguous, so
the result needs no copy back; all-gathers receive rank-major and are copied once into [b, s, h].
"""

from __future__ import annotations

import torch

from pyparallel import comm


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


def _split(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    dim = _dim(x, dim)
    if x.shape[dim] % group.size:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) "
                         f"over {group.size} tensor-parallel ranks: it must be divisible by {group.size}")
    chunk = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * chunk, chunk).contiguous()


def _to_rank_major(x: torch.Tensor, t: int, dim: int) -> torch.Tensor:
    """``x`` [.., s, ..] as a contiguous [t, .., s/t, ..]: slice r is rank r's chunk along ``dim``, itself
    contiguous. A view when every dimension before ``dim`` has size 1, else one copy."""
    dim = _dim(x, dim)
    return x.unflatten(dim, (t, x.shape[dim] // t)).movedim(dim, 0).contiguous()


def _gather(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (all-gather), in rank order."""
    dim = _dim(x, dim)
    x = x.contiguous()
    out = x.new_empty((group.size, *x.shape))  # rank-major: each rank's piece lands contiguous
    comm.all_gather(out.view(-1), x.view(-1), group)  # flat: gloo wants 1-D
    # [t, ..., d, ...] -> [..., t, d, ...] -> [..., t*d, ...]: the same as torch.cat(out.unbind(0), dim)
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _check_scatter(x: torch.Tensor, group: comm.Group, dim: int) -> int:
    dim = _dim(x, dim)
    if x.shape[dim] % group.size:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) "
                         f"over {group.size} tensor-parallel ranks: it must be divisible by {group.size}")
    return dim


def start_reduce_scatter(x: torch.Tensor, group: comm.Group, dim: int):
    """Start summing ``x`` over the group, keeping this rank's chunk along ``dim``; returns ``(out, handle,
    source)``: ``out`` is valid once ``handle.wait()`` returns, and ``source`` must stay alive until then.
    ``x`` itself is only read (never written), so it may be anyone's."""
    dim = _check_scatter(x, group, dim)
    source = _to_rank_major(x, group.size, dim)  # at most one copy; slice r is already the output layout
    shape = list(x.shape)
    shape[dim] //= group.size
    out = x.new_empty(shape)
    handle = comm.reduce_scatter(out.view(-1), source.view(-1), group, async_op=True)
    return out, handle, source


def _reduce_scatter(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    out, handle, _source = start_reduce_scatter(x, group, dim)
    handle.wait()
    return out


def _all_reduce(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor someone else may hold
    comm.all_reduce(x, group)
    return x


def _all_reduce_owned(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """In place when ``x`` is contiguous (a buffer the caller owns, see the module docstring)."""
    if not x.is_contiguous():
        return _all_reduce(x, group)
    comm.all_reduce(x, group)
    return x


class SharedInput:
    """The entry mapping (``f``, or the sequence all-gather) of one tensor that several column-parallel
    layers read, e.g. q, k and v through an :class:`~pyparallel.tensor_parallel.layers.InputCache`.

    Its output is handed only to those layers, so the gradient that reaches it is a sum of their fresh
    input gradients: the entry reduces it in place. ``readers`` counts the layers that were handed the
    output (the cache adds one per hit). A lone reader in the replicated mode (``kind == "copy"``) all-reduces
    its own input gradient, overlapped with its weight gradient, and the entry passes it on unchanged;
    under sequence parallelism the entry reduce-scatters (the shapes differ: the reader cannot do it)."""

    __slots__ = ("kind", "readers")

    def __init__(self, kind: str):
        self.kind, self.readers = kind, 1

    @property
    def reduced_by_reader(self) -> bool:
        return self.kind == "copy" and self.readers == 1


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (in place behind a :class:`SharedInput`)."""

    @staticmethod
    def forward(ctx, x, group, shared):
        ctx.group, ctx.shared = group, shared
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.shared is None:
            return _all_reduce(grad, ctx.group), None, None
        if ctx.shared.reduced_by_reader:
            return grad, None, None
        return _all_reduce_owned(grad, ctx.group), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward. ``owned``: ``x`` is the caller's fresh product, summed in
    place (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, group, owned):
        if owned and x.is_contiguous():
            comm.all_reduce(x, group)
            ctx.mark_dirty(x)
            return x
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(torch.autograd.Function):
    """Split along ``dim`` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along ``dim`` forward; keep this rank's chunk of the (replicated) gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    """All-gather along ``dim`` forward; reduce-scatter the (partial) gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, group: comm.Group, shared: SharedInput | None = None) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward. ``shared``: the output goes
    only to column-parallel layers (the gradient is then reduced in place; see :class:`SharedInput`)."""
    return x if group.size == 1 else _CopyToTP.apply(x, group, shared)


def reduce_from_tp(x: torch.Tensor, group: comm.Group, *, owned: bool = False) -> torch.Tensor:
    """Megatron's ``g``: all-reduce forward (sum of partial outputs), identity backward. ``owned=True``:
    ``x`` is a product the caller has just made and nothing else reads; it is summed in place."""
    return x if group.size == 1 else _ReduceFromTP.apply(x, group, owned)


def scatter_to_tp(x: torch.Tensor, group: comm.Group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` (default: features); the gradient is all-gathered."""
    return x if group.size == 1 else _ScatterToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group: comm.Group, dim: int = -1) -> torch.Tensor:
    """All-gather chunks along ``dim`` into a replicated tensor; backward keeps this rank's chunk."""
    return x if group.size == 1 else _GatherFromTP.apply(x, group, dim)


def scatter_to_sequence(x: torch.Tensor, group: comm.Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism: split a replicated [b, s, h] activation along the sequence (no traffic)."""
    return scatter_to_tp(x, group, dim)


def gather_from_sequence(x: torch.Tensor, group: comm.Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism's ``f``: all-gather the sequence shards; reduce-scatter the gradient."""
    return x if group.size == 1 else _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group: comm.Group, dim: int = 1) -> torch.Tensor:
    """Sequence parallelism's ``g``: sum partial outputs and keep this rank's sequence shard."""
    return x if group.size == 1 else _ReduceScatterToSequence.apply(x, group, dim)


def allreduce_grad_hook(group: comm.Group):
    """A tensor hook that sums a parameter's gradient over ``group``.

    Sequence parallelism runs LayerNorms (and row-parallel biases) on 1/t of the tokens, so each rank's
    gradient for these replicated parameters is a partial sum. Registered with ``param.register_hook``,
    it acts on each backward's contribution before accumulation, so gradient accumulation stays right."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        comm.all_reduce(grad, group)
        return grad

    return hook


def register_allreduce_grad_hook(param: torch.Tensor, group: comm.Group) -> None:
    """``param.register_hook(allreduce_grad_hook(group))``, on a frozen parameter too.

    torch refuses a hook on a tensor that does not require grad, but a frozen parameter may be unfrozen
    later (gradual unfreezing); without its hook each rank would then train on its own partial sum, the TP
    ranks drifting apart silently. So the flag is lifted for the registration and put back; the hook stays
    on the tensor and fires once it has a gradient again."""
    frozen = not param.requires_grad
    param.requires_grad_(True)
    try:
        param.register_hook(allreduce_grad_hook(group))
    finally:
        param.requires_grad_(not frozen)
