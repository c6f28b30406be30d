"""Batches over the mesh: each data-parallel replica's share of a global batch, micro-batches of a share,
and the data-parallel mean of a logged number.

    mesh = pyparallel.init(dp=2, pp=2)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}   # the global batch, every rank
    mine = pyparallel.data.shard_batch(batch, mesh)                         # this replica's rows
    loss = model.step(mine["input_ids"], labels=mine["labels"], attention_mask=mine["attention_mask"])

A batch is a tensor, a tuple / list of tensors, or a dict whose values are tensors (batch dimension first,
the same size in all of them). Replica ``d`` gets the ``d``-th contiguous block of rows, which is what
``ParallelModel.batch_slice`` gives too: every TP and PP rank of a replica computes the same rows from the
same global batch, with no communication.

``dp_mean`` is for numbers each replica computes on its own rows (a per-rank loss under ``DataParallel``
or ``zero.setup``, an accuracy). The loss returned by ``PipelineParallel.step`` and ``ParallelModel.step``
is already the mean over the global batch's tokens, the same on every rank: it needs no ``dp_mean``. Note
that the mean of per-replica token means equals the global token mean only when the replicas hold the
same number of tokens.
"""

from __future__ import annotations

import torch

from pyparallel import comm


def _rows(batch) -> list[tuple[str, torch.Tensor]]:
    """(name for messages, tensor) of every tensor in ``batch``; ValueError for anything else."""
    if isinstance(batch, torch.Tensor):
        items = [("the batch", batch)]
    elif isinstance(batch, dict):
        items = [(f"batch[{k!r}]", v) for k, v in batch.items()]
    elif isinstance(batch, (tuple, list)):
        items = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        raise ValueError(f"a batch is a tensor, a tuple/list of tensors or a dict of tensors, got a "
                         f"{type(batch).__name__}")
    if not items:
        raise ValueError("the batch is empty: it holds no tensors")
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            what = f"a {type(t).__name__}" if not isinstance(t, torch.Tensor) else "a 0-d tensor"
            raise ValueError(f"{name} is {what}; every entry of a batch must be a tensor with a batch dimension")
    sizes = {name: t.shape[0] for name, t in items}
    if len(set(sizes.values())) > 1:
        seen = ", ".join(f"{n}: {s}" for n, s in sizes.items())
        raise ValueError(f"the tensors of a batch must share the batch (first) dimension, got {seen}")
    return items


def batch_size(batch) -> int:
    """The number of samples (rows) in ``batch``."""
    return _rows(batch)[0][1].shape[0]


def _rebuild(batch, parts):
    if isinstance(batch, torch.Tensor):
        return parts[0]
    if isinstance(batch, dict):
        return dict(zip(batch.keys(), parts))
    return type(batch)(parts)


def dp_slice(size: int, dp: int, dp_rank: int) -> slice:
    """Rows ``[dp_rank * size/dp, (dp_rank + 1) * size/dp)`` of a global batch of ``size`` samples."""
    if size % dp:
        raise ValueError(f"the global batch of {size} samples does not divide over dp={dp} data-parallel "
                         f"replicas; use a batch size that is a multiple of {dp}")
    share = size // dp
    return slice(dp_rank * share, (dp_rank + 1) * share)


def shard_batch(batch, mesh):
    """This data-parallel replica's rows of the global ``batch`` (same structure, views of the rows).

    ValueError, before any communication, when the batch size is not divisible by ``mesh.dp``."""
    rows = dp_slice(batch_size(batch), mesh.dp, mesh.dp_rank)
    return _rebuild(batch, [t[rows] for _, t in _rows(batch)])


def microbatches(batch, m: int) -> list:
    """``batch`` cut into ``m`` equal micro-batches along the batch dimension (each of the same structure).

    The split ``PipelineParallel.step`` uses for its inputs, targets and attention mask; also for
    gradient accumulation by hand. ValueError when ``m`` does not divide the batch."""
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"the number of micro-batches must be a positive integer, got {m!r}")
    size = batch_size(batch)
    if size % m:
        raise ValueError(f"the batch of {size} samples is not divisible by num_microbatches ({m}); use a "
                         f"batch that is a multiple of {m}")
    pieces = [t.tensor_split(m) for _, t in _rows(batch)]
    return [_rebuild(batch, [p[i] for p in pieces]) for i in range(m)]


def global_token_count(labels: torch.Tensor, mesh) -> int:
    """How many tokens a causal-LM loss scores in the global batch: labels ``[..., seq]`` in Hugging Face's
    unshifted convention (position t is scored against token t + 1, so the first column never counts; -100
    ignored), summed over the data-parallel replicas (one all-reduce of one number over ``mesh.dp_group``).

    For a replica that averages its gradients over DP (``DataParallel``, ``zero.setup``), passing
    ``num_items_in_batch=global_token_count(labels, mesh) / mesh.dp`` to a Hugging Face model makes each
    rank's loss its token sum over that share of the count, so the averaged gradients are those of HF's loss
    on the whole global batch (the mean over all its tokens), and ``dp_mean`` of the losses is that loss.
    ``PipelineParallel`` and ``parallelize`` count this way by themselves."""
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dim() < 1:
        raise ValueError("global_token_count takes an integer tensor of labels [..., seq] (-100 ignored)")
    count = (labels[..., 1:] != -100).sum().reshape(1).to(device=mesh.device, dtype=torch.int64)
    if mesh.dp > 1:
        comm.all_reduce(count, mesh.dp_group)
    return int(count.item())


def dp_mean(value, mesh):
    """The mean of ``value`` over the data-parallel replicas (a collective over ``mesh.dp_group``: every
    rank of the group must call it). ``value``: a Python number or a one-element tensor; returns a float
    for a number, a tensor of the input's dtype and device for a tensor. Summed in float64."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"dp_mean averages one number; got a tensor of shape {tuple(value.shape)}")
        total = value.detach().reshape(1).to(device=mesh.device, dtype=torch.float64)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        total = torch.tensor([float(value)], dtype=torch.float64, device=mesh.device)
    else:
        raise ValueError(f"dp_mean takes a number or a one-element tensor, got a {type(value).__name__}")
    if mesh.dp > 1:
        comm.all_reduce(total, mesh.dp_group)
    mean = total / mesh.dp
    if isinstance(value, torch.Tensor):
        return mean.reshape(value.shape).to(device=value.device, dtype=value.dtype)
    return float(mean.item())
