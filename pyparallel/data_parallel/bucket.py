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

from pyparallel import _ops


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

    def gather_grads(self) -> None:
        """Copy every parameter's current gradient into the buffer in one multi-tensor op (zeros for None)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        _ops.flatten_into(grads, self.buffer)


def build_buckets(named_params: list[tuple[str, nn.Parameter]], cap_bytes: int,
                  dtype: torch.dtype | None = None) -> list[Bucket]:
    """Group ``named_params`` (in registration order) into buckets of at most ``cap_bytes`` (a single larger
    parameter gets a bucket of its own), filling from the last parameter backwards. Parameters of different
    dtypes or devices never share a bucket."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket capacity must be positive, got {cap_bytes} bytes")
    buckets: list[Bucket] = []
    current: list[tuple[str, nn.Parameter]] = []
    size = 0

    def close():
        nonlocal current, size
        if current:
            p0 = current[0][1]
            numel = sum(p.numel() for _, p in current)
            buf = torch.zeros(numel, dtype=dtype or p0.dtype, device=p0.device)
            buckets.append(Bucket(len(buckets), [p for _, p in current], [n for n, _ in current], buf))
        current, size = [], 0

    for name, p in reversed(named_params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0][1].dtype
                        or p.device != current[0][1].device):
            close()
        current.append((name, p))
        size += nbytes
    close()
    return buckets
