"""Flat gradient buckets: parameters grouped, in the order their gradients become ready, into flat buffers
that are reduced with one collective each (Li et al. 2020, "PyTorch Distributed", section 3.2.3).

Backward produces gradients roughly in reverse registration order, so buckets are filled from the last
parameter to the first; each bucket's reduction can start while the earlier layers are still in backward.
Each parameter's gradient is a view into its bucket (``gradient_as_bucket_view``), so autograd accumulates
straight into the buffer that goes on the wire and no copy is needed after the first step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass(eq=False)
class Bucket:
    """One flat buffer and the parameters whose gradients live in it."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    ready: list[bool] = field(default_factory=list)
    handle: object = None
    comm_buffer: torch.Tensor | None = None  # set when gradients are reduced in another dtype

    def __post_init__(self):
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = [False] * len(self.params)

    @property
    def pending(self) -> int:
        return self.ready.count(False)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.handle = None

    def adopt_grad(self, i: int) -> None:
        """Make parameter i's gradient the bucket view (copying it in if autograd allocated a new one)."""
        p, view = self.params[i], self.views[i]
        grad = p.grad
        if grad is view:  # the steady state: autograd accumulated into the bucket itself
            return
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        p.grad = view


def bucket_groups(named_params: list[tuple[str, nn.Parameter]], cap_bytes: int,
                  elem_bytes: int | None = None) -> list[list[tuple[str, nn.Parameter]]]:
    """Group ``named_params`` into buckets, filling from the last parameter backwards (backward produces
    gradients roughly in reverse registration order, so the first bucket completes first: Li et al. 2020,
    section 3.2.3). A bucket takes parameters until it holds ``cap_bytes`` or more, so it exceeds the cap
    by at most its last parameter, as torch DDP's buckets do: a bucket closed early, below the cap, would
    spend a whole collective on a few small parameters (a LayerNorm between two large matrices).
    Parameters of different dtypes or devices never share a bucket. ``elem_bytes``: bytes per element to
    count (default: each parameter's own)."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket capacity must be positive, got {cap_bytes} bytes")
    groups: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in reversed(named_params):
        if current and (size >= cap_bytes or p.dtype != current[0][1].dtype or p.device != current[0][1].device):
            groups.append(current)
            current, size = [], 0
        current.append((name, p))
        size += p.numel() * (elem_bytes or p.element_size())
    if current:
        groups.append(current)
    return groups


def build_buckets(named_params: list[tuple[str, nn.Parameter]], cap_bytes: int,
                  dtype: torch.dtype | None = None) -> list[Bucket]:
    """:func:`bucket_groups` with a zeroed flat gradient buffer per bucket (in ``dtype``, default the
    parameters')."""
    buckets: list[Bucket] = []
    for group in bucket_groups(named_params, cap_bytes):
        p0 = group[0][1]
        buf = torch.zeros(sum(p.numel() for _, p in group), dtype=dtype or p0.dtype, device=p0.device)
        buckets.append(Bucket(len(buckets), [p for _, p in group], [n for n, _ in group], buf))
    return buckets
