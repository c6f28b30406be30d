"""Flatten, pad and shard: the index arithmetic every ZeRO stage shares.

ZeRO (Rajbhandari et al. 2020, section 5) partitions model states into N equal parts, one per
data-parallel rank. Here the unit of partitioning is a *flat group*: a run of parameters laid end to end in
one 1-D buffer, padded with zeros to a multiple of N so that reduce-scatter and all-gather move equal
slices. Rank r owns elements ``[r*S, (r+1)*S)`` of every group (S = padded/N). Stages 1 and 2 use gradient
buckets as groups; stage 3 uses wrapped units (a transformer block, the embedding, ...).

A rank's shards of all groups are concatenated into one contiguous *shard space* of ``sum(S_g)`` elements,
so its fp32 master weights, gradient shard and optimizer state are each one tensor: one torch optimizer
(or one offloaded optimizer) updates everything a rank owns in a single call. This is exact for
element-wise optimizers (SGD, Adam, AdamW, ...): the same arithmetic happens per element whether the
elements sit in one tensor or many.

Padding never leaks: padded gradient slots are zero (nothing writes them), so they add nothing to norms,
and an element-wise optimizer keeps a zero weight with zero gradient and zero state at zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from pyparallel import _ops, comm
from pyparallel.data_parallel.bucket import bucket_groups


def padded_size(numel: int, world: int) -> int:
    """Smallest multiple of ``world`` that holds ``numel`` elements (at least ``world``: every rank owns
    one slot, so a group smaller than N still has a defined shard on each rank)."""
    return max(world, -(-numel // world) * world)


@dataclass(eq=False)
class FlatLayout:
    """Where each parameter of one flat group lives, and which slice rank r owns."""

    names: list[str]
    params: list[nn.Parameter]
    world: int
    offsets: list[int] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)  # recorded: stage 3 empties the parameters
    numels: list[int] = field(default_factory=list)
    numel: int = 0
    split: int = 1  # each rank's slice is cut again into this many owned parts (a tied weight's stages)

    def __post_init__(self):
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            self.shapes.append(p.shape)
            self.numels.append(p.numel())
            offset += p.numel()
        self.numel = offset

    @property
    def padded(self) -> int:
        return padded_size(self.numel, self.world * self.split)

    @property
    def shard_numel(self) -> int:
        return self.padded // self.world

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    def owned_range(self, rank: int, part: int) -> tuple[int, int]:
        """Part ``part`` of rank ``rank``'s slice: the elements that rank's holder number ``part`` updates
        when the slice is shared by ``split`` holders (a weight tied across pipeline stages, see
        ``zero.engine``)."""
        a, _ = self.shard_range(rank)
        s = self.shard_numel // self.split
        return a + part * s, a + (part + 1) * s

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (original shapes) into a full flat buffer of this layout."""
        return [flat[o : o + n].view(shape) for o, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def split_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Like :meth:`views` but through one ``split`` (autograd: a single SplitWithSizes node whose backward
        writes one flat gradient, instead of one full-size gradient per slice)."""
        sizes = self.numels + ([self.padding] if self.padding else [])
        parts = flat.split(sizes)
        return [part.view(shape) for part, shape in zip(parts, self.shapes)]

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
        """A new padded flat buffer holding ``tensors`` (cast to ``dtype``), padding zeroed."""
        flat = torch.empty(self.padded, dtype=dtype, device=device)
        if self.padding:
            flat[self.numel :].zero_()
        if any(t.is_meta for t in tensors):  # a meta model: the loader fills the shards next
            flat.zero_()
        elif tensors:
            _ops.flatten_into([t.detach() for t in tensors], flat)
        return flat


class ShardSpace:
    """The concatenation of this rank's slices of several flat groups: one contiguous index space."""

    def __init__(self, layouts: list[FlatLayout], rank: int):
        self.layouts = layouts
        self.rank = rank
        self.offsets = []
        total = 0
        for layout in layouts:
            self.offsets.append(total)
            total += layout.shard_numel
        self.numel = total

    def slice(self, tensor: torch.Tensor, g: int) -> torch.Tensor:
        """Group ``g``'s part of a shard-space tensor."""
        return tensor[self.offsets[g] : self.offsets[g] + self.layouts[g].shard_numel]

    @property
    def padded_numel(self) -> int:
        """Elements over all ranks, padding included (N x numel)."""
        return sum(layout.padded for layout in self.layouts)

    def new(self, dtype: torch.dtype, device, zero: bool = True) -> torch.Tensor:
        return (torch.zeros if zero else torch.empty)(self.numel, dtype=dtype, device=device)

    def shard_of(self, fulls: list[torch.Tensor], out: torch.Tensor) -> None:
        """Copy this rank's slice of each full flat buffer (one per group) into a shard-space tensor."""
        for g, (layout, full) in enumerate(zip(self.layouts, fulls)):
            a, b = layout.shard_range(self.rank)
            self.slice(out, g).copy_(full[a:b])


@torch.no_grad()
def gather_named(space: ShardSpace, shard: torch.Tensor, group: comm.Group, dtype: torch.dtype | None = None
                 ) -> dict[str, torch.Tensor]:
    """All-gather a shard-space tensor (e.g. the fp32 master) and return the full value of every parameter
    by name (a collective: every rank of ``group`` must call it)."""
    dtype = dtype or shard.dtype
    out: dict[str, torch.Tensor] = {}
    for g, layout in enumerate(space.layouts):
        piece = space.slice(shard, g).to(dtype)
        full = torch.empty(layout.padded, dtype=dtype, device=piece.device)
        comm.all_gather(full, piece.contiguous(), group)
        for name, view in zip(layout.names, layout.views(full)):
            out[name] = view.clone()
    return out


def plan_buckets(named_params: list[tuple[str, nn.Parameter]], cap_bytes: int, world: int,
                 elem_bytes: int) -> list[FlatLayout]:
    """Flat groups (padded to a multiple of ``world``) of the buckets
    :func:`pyparallel.data_parallel.bucket.bucket_groups` forms, counting ``elem_bytes`` per element."""
    return [FlatLayout([n for n, _ in g], [p for _, p in g], world)
            for g in bucket_groups(named_params, cap_bytes, elem_bytes)]


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (and every view of it) alive, so autograd's saved views
    can be refilled later by :func:`alloc_storage` (the FSDP "resharding" trick)."""
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def storage_allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() != 0
