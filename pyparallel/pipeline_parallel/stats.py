"""What a pipeline step measures about itself: busy and idle time per stage, the bubble, live activations.

* **busy**: wall time in forward and backward compute of this stage's chunks.
* **idle**: wall time blocked on the pipeline — waiting for an activation or gradient from a neighbour,
  for the step's sends, and for the flush at the end of the step (the all-reduce of the loss over the
  pipeline group, which every stage reaches only after the last backward of the whole pipeline).
* **weight**: the part of busy spent in deferred W passes (zero-bubble schedules), and how many of them
  ran early, to fill a wait for a message.
* **action_s**: busy time per action kind and chunk (``"F3"``, ``"B3"``, ``"W3"``: forward, backward or
  its input-gradient half, weight gradients of chunk 3), summed over the steps' ``microbatches``; their
  ratio is the stage's measured time per micro-batch, which ``bubble_simulated`` replays.
* **split**: per step, how this stage's backward passes were split — ``split`` (B computed the input
  gradient only), ``no_input_grad`` (the first chunk: B empty, all of it in W), ``full_checkpointed``
  (activation checkpointing: the whole backward in B, W empty) — and how many weight groups W ran
  (``weight_groups``), of which ``weight_groups_direct`` skipped the autograd engine (``split.py``).
* **bubble** = idle / (busy + idle), per stage; the pipeline's is the mean over stages. The theory it is
  compared with, ``(p - 1) / (v m + p - 1)``, assumes equal chunk times and free messages;
  ``bubble_simulated`` plays this rank's list against the others' at the measured action times with free
  messages, so what it leaves is the schedule's at these times (an uneven split included), and the
  measured bubble's excess over it is what messages, waits and the runtime add.

Activation bytes are measured, not estimated: :class:`SavedTensorMeter` installs autograd saved-tensor
hooks and counts the bytes of every distinct storage autograd keeps for backward (parameters excluded),
releasing them when autograd frees them. It works around any code that runs forward in this thread,
including ``torch.distributed.pipelining``'s, so the benchmark measures both the same way.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class StepRecord:
    busy_s: float = 0.0
    idle_s: float = 0.0
    wall_s: float = 0.0
    peak_inflight: int = 0
    peak_activation_bytes: int | None = None
    weight_s: float = 0.0
    microbatches: int = 0
    action_s: dict = field(default_factory=dict)
    early_w: int = 0
    split: dict | None = None

    @property
    def bubble(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


@dataclass
class StageStats:
    """Accumulated over the steps since the last reset on one stage."""

    steps: list[StepRecord] = field(default_factory=list)

    def summary(self) -> dict:
        if not self.steps:
            return {"steps": 0}
        busy = sum(s.busy_s for s in self.steps)
        idle = sum(s.idle_s for s in self.steps)
        act = [s.peak_activation_bytes for s in self.steps if s.peak_activation_bytes is not None]
        return {
            "steps": len(self.steps),
            "busy_s": busy,
            "idle_s": idle,
            "bubble": idle / (busy + idle) if busy + idle > 0 else 0.0,
            # Robust to a step the OS scheduler stretched (shared or oversubscribed cores).
            "bubble_median_step": statistics.median(s.bubble for s in self.steps),
            "median_step_s": statistics.median(s.wall_s for s in self.steps),
            "peak_inflight": max(s.peak_inflight for s in self.steps),
            "peak_activation_bytes": max(act) if act else None,
            "microbatches": sum(s.microbatches for s in self.steps),
            "action_s": {k: sum(s.action_s.get(k, 0.0) for s in self.steps)
                         for k in sorted({k for s in self.steps for k in s.action_s})},
            "weight_s": sum(s.weight_s for s in self.steps),
            "early_w": sum(s.early_w for s in self.steps),
            "split": self.steps[-1].split,
            "last_step": asdict(self.steps[-1]),
        }


class SavedTensorMeter:
    """Counts live bytes of tensors autograd saves for backward; ``peak`` is the high-water mark.

    Use as a context manager around forward passes. A storage saved several times counts once;
    storages of ``exclude`` tensors (the parameters) do not count."""

    def __init__(self, exclude=()):
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._ctx = None

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, t: torch.Tensor):
        # Detached: a saved output kept with its grad_fn would make a C++ cycle (node -> saved tensor ->
        # node) that leaks the graph when it is dropped without a backward (pytorch/pytorch#189025).
        t = t.detach()
        if t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._skip or ptr == 0:
            return t
        return _Held(self, t, ptr, storage.nbytes())

    @staticmethod
    def _unpack(obj):
        return obj.tensor if isinstance(obj, _Held) else obj

    def _add(self, ptr: int, nbytes: int) -> None:
        n = self._refs.get(ptr, 0)
        self._refs[ptr] = n + 1
        if n == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _release(self, ptr: int, nbytes: int) -> None:
        n = self._refs[ptr] - 1
        if n:
            self._refs[ptr] = n
        else:
            del self._refs[ptr]
            self.live -= nbytes

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None
        return False


class _Held:
    """A saved tensor plus the bookkeeping that releases its bytes when autograd drops it."""

    __slots__ = ("meter", "tensor", "ptr", "nbytes")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor, ptr: int, nbytes: int):
        self.meter, self.tensor, self.ptr, self.nbytes = meter, tensor, ptr, nbytes
        meter._add(ptr, nbytes)

    def __del__(self):
        self.meter._release(self.ptr, self.nbytes)
