"""Gradient reduce-scatter into shards, asynchronous and bounded: the reduction half of ZeRO stages 1-3.

A full flat gradient (one bucket or one stage-3 unit, padded to a multiple of N) is reduce-scattered
(averaged or summed over the data-parallel ranks); rank r keeps slice r in its gradient shard. Collectives are
issued asynchronously so that backward keeps computing the next layers' gradients while they run
(ZeRO section 5.2: "reduce-scatter ... overlapped with backward"), and at most ``max_inflight`` are
outstanding: beyond that the oldest is waited for, which bounds the transient full-gradient buffers a
rank holds at once (their memory is what stage 2 saves).

Accumulation: the first reduction into a clean shard slice writes it directly; later ones (more
micro-batches before the step) go through a shard-sized scratch and are added, always in launch order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from pyparallel import comm


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@dataclass(eq=False)
class _Pending:
    handle: comm.Handle
    full: torch.Tensor  # kept alive until the collective completes
    out: torch.Tensor
    target: torch.Tensor
    mode: str  # "direct" (out is target), "copy" or "add"
    on_done: object


class ShardReducer:
    """Launch reduce-scatters of full flat gradients into shard slices; complete them in launch order."""

    def __init__(self, group: comm.Group, max_inflight: int = 2, op: str = "avg"):
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.group = group
        self.max_inflight = max_inflight
        self.op = op  # "avg" (zero.setup: per-rank mean losses) or "sum" (parallelize: pre-scaled losses)
        self._pending: deque[_Pending] = deque()

    def launch(self, full: torch.Tensor, target: torch.Tensor, accumulate: bool, scratch: bool = False,
               on_done=None) -> None:
        """Reduce ``full`` (N x target.numel() elements; mean or sum, ``op``) into ``target`` (this rank's slice):
        ``target += mean`` when ``accumulate``, else ``target = mean``. ``scratch``: ``full`` is a transient
        buffer that may be overwritten (the reduction then runs in place, see
        ``comm.reduce_scatter_in_place``). ``on_done()`` runs after completion (e.g. to free ``full``)."""
        if full.dtype != target.dtype:
            raise ValueError(f"reduce-scatter input dtype {full.dtype} differs from shard dtype {target.dtype}")
        if shares_storage(full, target):
            raise ValueError("the gradient shard must not live inside the buffer being reduced")
        mode = "add" if accumulate else "copy"
        if scratch:
            handle = comm.reduce_scatter_in_place(full, self.group, op=self.op, async_op=True)
            out = full.view(self.group.size, -1)[self.group.rank]
        else:
            out = torch.empty_like(target) if accumulate else target
            mode = "add" if accumulate else "direct"
            handle = comm.reduce_scatter(out, full, self.group, op=self.op, async_op=True)
        self._pending.append(_Pending(handle, full, out, target, mode, on_done))
        while len(self._pending) > self.max_inflight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        p = self._pending.popleft()
        p.handle.wait()
        if p.mode == "add":
            p.target.add_(p.out)
        elif p.mode == "copy":
            p.target.copy_(p.out)
        if p.on_done is not None:
            p.on_done()

    def drain(self) -> None:
        """Wait for every outstanding reduction (end of backward)."""
        while self._pending:
            self._complete_oldest()
