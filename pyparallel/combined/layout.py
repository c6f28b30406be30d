"""Where each of a rank's parameters sits in the *global* (unparallelised) model.

Under DP x TP x PP a rank holds, for every parameter of its pipeline stage, either the whole tensor (a
replicated LayerNorm, a row-parallel bias) or a tensor-parallel shard of it, and with ZeRO only a flat
range of that. Checkpoints, gradient norms and ``full_state_dict`` all need the same facts about each
local tensor: its global name and shape, which boxes of the global tensor its flat (row-major) elements
are, and whether this rank is the one that *counts* it (replicated copies must be counted once).

Megatron-LM's layers (Shoeybi et al. 2019) split a Linear ``Y = X A`` by output features (column: rows of
``weight``) or input features (row: columns of ``weight``); a fused QKV splits each of q, k, v separately
(one box per section); a transformers ``Conv1D`` stores ``A`` itself ([in, out]), so the local shard is the
transposed box (``perm=(1, 0)``).

A vocabulary padded for TP (Megatron's ``make-vocab-size-divisible-by``: the embedding and the LM head hold
``Vp >= V`` rows) is described in the *original* vocabulary: the global shape has V rows and a rank's
segments cover only its real rows, so the padding rows (the tail of the last ranks' shards) are in no piece:
never saved, never counted, and left as they are (zero) by a load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn


@dataclass(frozen=True)
class Segment:
    """Elements ``[local_start, local_start + numel)`` of a local tensor's flat order are the box
    ``box_offsets`` / ``box_shape`` of the global tensor, held permuted by ``perm`` (None: as is)."""

    box_offsets: tuple[int, ...]
    box_shape: tuple[int, ...]
    perm: tuple[int, ...] | None
    local_start: int
    numel: int


@dataclass
class ParamInfo:
    """One local parameter: its global name and shape, its segments, and whether this rank counts it."""

    name: str
    global_shape: tuple[int, ...]
    segments: list[Segment]
    tp_sharded: bool
    counted: bool = True  # False on the redundant holders of a replicated tensor (TP rank > 0, tie copies)
    tie_stages: tuple[int, ...] = field(default_factory=tuple)


def _whole(shape) -> list[Segment]:
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    return [Segment((0,) * len(shape), shape, None, 0, n)]


def _column(module, pname: str, t: int, r: int) -> tuple[tuple, list[Segment]]:
    """ColumnParallelLinear: rows (output features) of each section; a padded vocabulary head only its real
    rows (``valid_out`` of the global ``out_features``)."""
    out_f, in_f = getattr(module, "valid_out", module.out_features), module.in_features
    sections = module.sections or (module.out_features,)
    conv = module.layout == "conv1d"
    segs, offset, start = [], 0, 0
    for size in sections:
        row0 = offset + r * (size // t)
        k = max(0, min(size // t, out_f - row0))  # without padding: size // t
        if pname == "bias":
            segs.append(Segment((row0,), (k,), None, start, k))
            start += k
        elif conv:  # global [in, out]: the box is columns row0..row0+k, held transposed as [k, in]
            segs.append(Segment((0, row0), (in_f, k), (1, 0), start, k * in_f))
            start += k * in_f
        else:
            segs.append(Segment((row0, 0), (k, in_f), None, start, k * in_f))
            start += k * in_f
        offset += size
    if pname == "bias":
        return (out_f,), segs
    return ((in_f, out_f) if conv else (out_f, in_f)), segs


def _row(module, pname: str, t: int, r: int) -> tuple[tuple, list[Segment]] | None:
    """RowParallelLinear: columns (input features) of the weight; the bias is replicated (None)."""
    if pname != "weight":
        return None
    out_f, in_f = module.out_features, module.in_features
    k = in_f // t
    if module.layout == "conv1d":  # global [in, out]: rows r*k.., held transposed as [out, k]
        return (in_f, out_f), [Segment((r * k, 0), (k, out_f), (1, 0), 0, k * out_f)]
    return (out_f, in_f), [Segment((0, r * k), (out_f, k), None, 0, out_f * k)]


def _vocab(module, pname: str) -> tuple[tuple, list[Segment]]:
    """VocabParallelEmbedding: its rows of the original vocabulary (padding rows excluded)."""
    rows = max(0, min(module.vocab_end, module.num_embeddings) - module.vocab_start)
    h = module.embedding_dim
    return (module.num_embeddings, h), [Segment((module.vocab_start, 0), (rows, h), None, 0, rows * h)]


def tp_owners(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id(parameter) -> (tensor-parallel layer, attribute) for every parameter a TP layer holds."""
    from pyparallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    owners = {}
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            for pname, p in module.named_parameters(recurse=False):
                owners.setdefault(id(p), (module, pname))
    return owners


def describe(name: str, p: nn.Parameter, owner, t: int, r: int) -> ParamInfo:
    """The :class:`ParamInfo` of local parameter ``p`` (global ``name``) on TP rank ``r`` of ``t``."""
    from pyparallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    found = None
    if owner is not None and t > 1:
        module, pname = owner
        if isinstance(module, ColumnParallelLinear):
            found = _column(module, pname, t, r)
        elif isinstance(module, RowParallelLinear):
            found = _row(module, pname, t, r)
        elif isinstance(module, VocabParallelEmbedding):
            found = _vocab(module, pname)
    if found is None:
        return ParamInfo(name, tuple(p.shape), _whole(p.shape), tp_sharded=False, counted=(r == 0))
    shape, segs = found
    covered = sum(s.numel for s in segs)
    if covered > p.numel() or not segs or segs[0].numel == 0:
        raise AssertionError(f"{name}: TP segments cover {covered} of {p.numel()} elements")
    return ParamInfo(name, shape, segs, tp_sharded=True, counted=True)


def flat_pieces(info: ParamInfo, start: int, stop: int):
    """The segments of ``info`` that the local flat range ``[start, stop)`` touches, as
    ``(segment, flat_start_in_box, length, offset_in_range)``: what one ZeRO shard of the tensor holds."""
    out = []
    for seg in info.segments:
        a = max(start, seg.local_start)
        b = min(stop, seg.local_start + seg.numel)
        if a < b:
            out.append((seg, a - seg.local_start, b - a, a - start))
    return out
