"""One rank's share of the pipeline: its model chunks, and forward/backward of one micro-batch.

The stage keeps, per (chunk, micro-batch) in flight, the chunk's input (a leaf that requires grad, so its
``.grad`` is the gradient to send back) and its output (or, on the last chunk, the micro-batch's scaled
loss). Backward of a micro-batch frees both, which is what bounds 1F1B's activation memory. Under a
zero-bubble schedule the backward is two actions (``split.py``): B returns the input gradient and keeps
the graph as a ``WeightPass``; W runs it and frees the micro-batch.

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

from pyparallel.pipeline_parallel import split as split_mod
from pyparallel.pipeline_parallel.split import backward_input, param_nodes_of
from pyparallel.tensor_parallel import random as tp_random


class Chunk(nn.Module):
    """A contiguous run of blocks: global chunk ``index`` of the pipeline."""

    def __init__(self, blocks, index: int, first_block: int, activation_checkpointing: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.index = index
        self.first_block = first_block
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask``: the micro-batch's padding mask, given to the blocks that take one (HF decoder
        layers, ``takes_attention_mask``); the others see only the hidden states."""
        for block in self.blocks:
            kw = {"attention_mask": attention_mask} if attention_mask is not None and \
                getattr(block, "takes_attention_mask", False) else {}
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Recompute the block in backward; only its input stays alive (non-reentrant: works with
                # inputs that need no grad, e.g. token ids, with keyword inputs and saved-tensor hooks).
                # context_fn replays the model-parallel RNG too: under TP, dropout on split activations
                # draws from it, and the recomputation must draw the forward's masks.
                x = checkpoint(block, x, use_reentrant=False, context_fn=tp_random.checkpoint_context, **kw)
            else:
                x = block(x, **kw)
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


def infer_shapes(meta_blocks, bounds, p: int, x: torch.Tensor, targets: torch.Tensor, loss_fn, place=None):
    """Shapes/dtypes crossing each chunk boundary for one micro-batch like ``x``, or None where the
    model cannot run on meta tensors (then only the runtime handshake checks). ValueError on a misfit.
    ``place(c)``: the rank of chunk ``c`` (default ``c % p``), for the messages."""
    place = place or (lambda c: c % p)
    x = torch.empty(x.shape, dtype=x.dtype, device="meta")
    targets = torch.empty(targets.shape, dtype=targets.dtype, device="meta")
    out = []
    with torch.no_grad():
        for c in range(len(bounds) - 1):
            blocks = meta_blocks[bounds[c]:bounds[c + 1]]
            where = f"chunk {c} (blocks {bounds[c]}..{bounds[c + 1] - 1} on stage {place(c)})"
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


class _NoTokens(torch.autograd.Function):
    """The loss of a micro-batch with no target token: 0, with a zero gradient for the outputs."""

    @staticmethod
    def forward(ctx, y):
        ctx.meta = (y.shape, y.dtype, y.device)
        return torch.zeros((), dtype=torch.float32 if y.dtype != torch.float64 else y.dtype, device=y.device)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.meta
        return torch.zeros(shape, dtype=dtype, device=device)


class StageCompute:
    """Forward and backward of single (chunk, micro-batch) pairs on this rank, timed as busy.

    ``split``: B computes only the input gradient and W the weight gradients later (zero-bubble
    schedules). A chunk with activation checkpointing is not split: its W would recompute every block once
    per weight group (each W group is its own autograd call, and checkpoint recomputes per call), so its
    B runs the whole backward and its W does nothing; ``split_counts`` records which way each went."""

    def __init__(self, chunks: dict[int, Chunk], num_chunks: int, loss_fn, meter=None, split: bool = False):
        self.chunks = chunks
        self.num_chunks = num_chunks
        self.loss_fn = loss_fn
        self.meter = meter
        self.split = split
        self._params = {c: [q for q in ch.parameters() if q.requires_grad] for c, ch in chunks.items()}
        self._param_nodes: dict[int, dict] = {}  # per chunk, for the split (one step: the parameters stay)
        self.state: dict[tuple[int, int], tuple] = {}
        self.pending_w: dict[tuple[int, int], object] = {}
        self.busy_s = 0.0
        # Seconds per action kind and chunk ("F3", "B3", "W3"), summed over the step's micro-batches: the
        # stage's measured compute times, which ``schedules.play`` replays to tell the schedule's own
        # bubble at these times from what messages and the runtime add.
        self.action_s: dict[str, float] = {}
        self.peak_inflight = 0
        self.loss_sum = 0.0
        # B passes that were split (input gradient only), that ran the whole backward (checkpointed
        # chunk), and that had no input gradient to compute (the first chunk: all of it is W).
        self.split_counts = {"split": 0, "full_checkpointed": 0, "no_input_grad": 0, "weight_groups": 0,
                             "weight_groups_direct": 0}

    def forward(self, c: int, mb: int, x: torch.Tensor, target=None, scale: float = 1.0, mask=None):
        """Run chunk ``c`` on micro-batch ``mb``; return the output to send (None on the last chunk).
        A received ``x`` arrives as a leaf that requires grad when its sender's output did. ``mask``: the
        micro-batch's attention mask (None: none)."""
        start = time.perf_counter()
        if self.meter is not None:
            with self.meter:
                y = self.chunks[c](x, mask)
                result = self._finish_forward(c, mb, x, y, target, scale)
        else:
            y = self.chunks[c](x, mask)
            result = self._finish_forward(c, mb, x, y, target, scale)
        self._spent("F", c, time.perf_counter() - start)
        self.peak_inflight = max(self.peak_inflight, len(self.state) + len(self.pending_w))
        return result

    def _finish_forward(self, c, mb, x, y, target, scale):
        if c == self.num_chunks - 1:
            if scale == 0.0:
                # No target token in this micro-batch (all -100, e.g. a row of padding): a mean over zero
                # terms is 0/0 = NaN, and NaN * 0 would poison every gradient. Its weight n_i / N is 0, so
                # it contributes a zero loss and zero gradients (every TP rank skips the loss alike: they
                # hold the same targets).
                scaled = _NoTokens.apply(y)
            else:
                scaled = self.loss_fn(y, target) * scale
            # A tensor sum, not float(): reading the value would synchronise a GPU every micro-batch.
            self.loss_sum = self.loss_sum + scaled.detach().to(torch.float64)
            self.state[(c, mb)] = (x, scaled)
            return None
        self.state[(c, mb)] = (x, y)
        return y

    def backward(self, c: int, mb: int, grad: torch.Tensor | None):
        """Backward of chunk ``c`` on micro-batch ``mb`` (its input-gradient half when splitting); return
        the input's gradient (None when the input needs none, i.e. on the first chunk)."""
        x, y = self.state.pop((c, mb))
        start = time.perf_counter()
        if self.split and not self.chunks[c].activation_checkpointing:
            if c not in self._param_nodes:
                self._param_nodes[c] = param_nodes_of(self._params[c])
            gx, wpass = backward_input(y, grad, x, self._params[c], self._param_nodes[c])
            self.pending_w[(c, mb)] = wpass
            kind = "split" if gx is not None else "no_input_grad"
            self.split_counts[kind] += 1
            self.split_counts["weight_groups"] += wpass.num_groups
            self.split_counts["weight_groups_direct"] += wpass.num_direct
            self._spent("B", c, time.perf_counter() - start)
            return gx if c != 0 and x.requires_grad else None
        if self.split:
            self.split_counts["full_checkpointed"] += 1
        if y.requires_grad:
            with split_mod.running(c):  # the chunk whose gradients these are (ZeRO-2's rounds, zero/engine.py)
                if grad is None:
                    torch.autograd.backward(y)
                else:
                    torch.autograd.backward(y, grad)
        self._spent("B", c, time.perf_counter() - start)
        if c == 0 or not x.requires_grad:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)

    def has_weight(self, c: int, mb: int) -> bool:
        """Whether B of (c, mb) has run, so its W may run."""
        return (c, mb) in self.pending_w

    def weight(self, c: int, mb: int, early: bool = False) -> list:
        """W of chunk ``c`` on micro-batch ``mb``: accumulate its weight gradients, free its graph.
        ``early``: it runs ahead of its place in the action list; returns what must run when the schedule
        reaches that place (``split.queue_in_place``; empty otherwise)."""
        wpass = self.pending_w.pop((c, mb), None)
        if wpass is None:  # not split (checkpointed chunk, or a schedule without W): B did everything
            return []
        start = time.perf_counter()
        with split_mod.running(c, early) as in_place:
            wpass.run()
        self._spent("W", c, time.perf_counter() - start)
        return in_place or []

    @property
    def weight_s(self) -> float:
        """Seconds in W passes this step."""
        return sum(t for k, t in self.action_s.items() if k[0] == "W")

    def _spent(self, kind: str, c: int, seconds: float) -> None:
        self.busy_s += seconds
        key = f"{kind}{c}"
        self.action_s[key] = self.action_s.get(key, 0.0) + seconds
