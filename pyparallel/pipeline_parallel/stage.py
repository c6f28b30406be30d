"""One rank's share of the pipeline: its model chunks, and forward/backward of one micro-batch.

The stage keeps, per (chunk, micro-batch) in flight, the chunk's input (a leaf that requires grad, so its
``.grad`` is the gradient to send back) and its output (or, on the last chunk, the micro-batch's scaled
loss). Backward of a micro-batch frees both, which is what bounds 1F1B's activation memory.

Shape inference runs the whole block list on the ``meta`` device (no memory, no compute) on every rank
alike, so a chunk that cannot take its predecessor's output — or targets that do not fit the outputs —
raise the same ValueError on every rank before any message is sent.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class Chunk(nn.Module):
    """A contiguous run of blocks: global chunk ``index`` of the pipeline."""

    def __init__(self, blocks, index: int, first_block: int, activation_checkpointing: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.index = index
        self.first_block = first_block
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Recompute the block in backward; only its input stays alive (non-reentrant: works with
                # inputs that need no grad, e.g. token ids, and with saved-tensor hooks).
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def describe(self, stage: int) -> str:
        last = self.first_block + len(self.blocks) - 1
        return f"chunk {self.index} (blocks {self.first_block}..{last} on stage {stage})"


# ------------------------------------------------------------------------------------ shape inference


def meta_copy(blocks) -> list[nn.Module]:
    """The blocks with every parameter and buffer on the meta device (ties preserved, no memory)."""
    memo = {}
    for b in blocks:
        for t in list(b.parameters()) + list(b.buffers()):
            if id(t) not in memo:
                meta = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return [copy.deepcopy(b, memo) for b in blocks]


_UNSUPPORTED = ("meta", "data-dependent", "not implemented", "notimplemented")


def infer_shapes(meta_blocks, bounds, p: int, x: torch.Tensor, targets: torch.Tensor, loss_fn):
    """Shapes/dtypes crossing each chunk boundary for one micro-batch like ``x``, or None where the
    model cannot run on meta tensors (then only the runtime handshake checks). ValueError on a misfit."""
    x = torch.empty(x.shape, dtype=x.dtype, device="meta")
    targets = torch.empty(targets.shape, dtype=targets.dtype, device="meta")
    out = []
    with torch.no_grad():
        for c in range(len(bounds) - 1):
            blocks = meta_blocks[bounds[c]:bounds[c + 1]]
            where = f"chunk {c} (blocks {bounds[c]}..{bounds[c + 1] - 1} on stage {c % p})"
            got = f"input of shape {tuple(x.shape)} ({x.dtype})"
            try:
                for b in blocks:
                    x = b(x)
            except NotImplementedError:
                return None
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                if any(s in str(exc).lower() for s in _UNSUPPORTED):
                    return None
                raise ValueError(f"pipeline: {where} cannot take an {got}"
                                 f"{' from chunk ' + str(c - 1) if c else ''}: {exc}") from None
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"pipeline: {where} returns a {type(x).__name__}; every block must return "
                                 f"one tensor")
            out.append((tuple(x.shape), x.dtype))
        try:
            loss = loss_fn(x, targets)
        except NotImplementedError:
            return None
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            if any(s in str(exc).lower() for s in _UNSUPPORTED):
                return None
            raise ValueError(f"pipeline: the loss cannot take the last chunk's output of shape "
                             f"{tuple(x.shape)} with targets of shape {tuple(targets.shape)}: {exc}") from None
        if loss.numel() != 1:
            raise ValueError(f"pipeline: loss_fn must return a scalar, got shape {tuple(loss.shape)}")
    return out[:-1]


# ------------------------------------------------------------------------------------------- compute


class StageCompute:
    """Forward and backward of single (chunk, micro-batch) pairs on this rank, timed as busy."""

    def __init__(self, chunks: dict[int, Chunk], num_chunks: int, loss_fn, meter=None):
        self.chunks = chunks
        self.num_chunks = num_chunks
        self.loss_fn = loss_fn
        self.meter = meter
        self.state: dict[tuple[int, int], tuple] = {}
        self.busy_s = 0.0
        self.peak_inflight = 0
        self.loss_sum = 0.0

    def forward(self, c: int, mb: int, x: torch.Tensor, target=None, scale: float = 1.0):
        """Run chunk ``c`` on micro-batch ``mb``; return the output to send (None on the last chunk).
        A received ``x`` arrives as a leaf that requires grad when its sender's output did."""
        start = time.perf_counter()
        if self.meter is not None:
            with self.meter:
                y = self.chunks[c](x)
                result = self._finish_forward(c, mb, x, y, target, scale)
        else:
            y = self.chunks[c](x)
            result = self._finish_forward(c, mb, x, y, target, scale)
        self.busy_s += time.perf_counter() - start
        self.peak_inflight = max(self.peak_inflight, len(self.state))
        return result

    def _finish_forward(self, c, mb, x, y, target, scale):
        if c == self.num_chunks - 1:
            loss = self.loss_fn(y, target)
            scaled = loss * scale
            # A tensor sum, not float(): reading the value would synchronise a GPU every micro-batch.
            self.loss_sum = self.loss_sum + scaled.detach().to(torch.float64)
            self.state[(c, mb)] = (x, scaled)
            return None
        self.state[(c, mb)] = (x, y)
        return y

    def backward(self, c: int, mb: int, grad: torch.Tensor | None):
        """Backward of chunk ``c`` on micro-batch ``mb``; return the input's gradient (None when the
        input needs none, i.e. on the first chunk)."""
        x, y = self.state.pop((c, mb))
        start = time.perf_counter()
        if y.requires_grad:
            if grad is None:
                torch.autograd.backward(y)
            else:
                torch.autograd.backward(y, grad)
        self.busy_s += time.perf_counter() - start
        if c == 0 or not x.requires_grad:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)
