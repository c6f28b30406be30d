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


def _gather(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (all-gather), in rank order."""
    dim = _dim(x, dim)
    x = x.contiguous()
    out = x.new_empty((group.size, *x.shape))
    comm.all_gather(out.view(-1), x.view(-1), group)  # flat: gloo wants 1-D
    # [t, ..., d, ...] -> [..., t, d, ...] -> [..., t*d, ...]: the same as torch.cat(out.unbind(0), dim)
    shape = list(x.shape)
    shape[dim] *= group.size
    return out.movedim(0, dim).reshape(shape)


def _reduce_scatter(x: torch.Tensor, group: comm.Group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    dim = _dim(x, dim)
    if x.shape[dim] % group.size:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) "
                         f"over {group.size} tensor-parallel ranks: it must be divisible by {group.size}")
    front = x.movedim(dim, 0).contiguous()  # rank r's chunk is then one contiguous slice
    out = front.new_empty((front.shape[0] // group.size, *front.shape[1:]))
    comm.reduce_scatter(out.view(-1), front.view(-1), group)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)  # never reduce into a tensor someone else holds
    comm.all_reduce(x, group)
    return x


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


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


def copy_to_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Megatron's ``g``: all-reduce forward (sum of partial outputs), identity backward."""
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


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
