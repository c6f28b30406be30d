"""Python's garbage collector held to step boundaries, so that no rank pauses inside a step.

CPython's cyclic collector starts whenever the count of newly allocated container objects passes a
threshold: at a different moment on every rank. A full (generation-2) collection walks every object the
process holds, which after ``import torch`` and a model is some 10^5 objects: ~80 ms per full collection
in the pipeline benchmark's workers, against a step of ~360 ms (``benchmarks/pipeline.py``, p = 2,
measured with ``gc.callbacks``). Inside a step the paused rank holds up every rank that waits for its next
message or collective, so one rank's pause becomes the job's; with many ranks some rank pauses in nearly
every step. Megatron-LM (``--manual-gc``) and torchtitan (``training.gc_freq``) turn the automatic
collector off and collect at the same point of every rank's loop for this reason.

* :func:`held`: the collector off for a block, restored after (blocks nest). ``PipelineParallel.step``
  runs its schedule inside one, and ``ParallelModel.step`` its whole step (ZeRO-3's gather, the pipeline,
  the optimizer's collectives): a collection that falls due mid-step runs after it, when every rank has
  drained, instead of stalling the ranks that wait on the paused one. A user's own loop calling
  ``forward_backward`` and ``optimizer.step()`` separately gets the first two only.
* :class:`StepCollector`: for a training loop (``pyparallel train --gc-every``). It collects once, then
  freezes the objects alive after setup (``gc.freeze``: the model, torch's and the libraries' own objects,
  which outlive the loop anyway and which later collections then no longer walk), turns the automatic
  collector off and collects every ``every`` steps, at the same point of the loop on every rank.
  ``close()`` gives the process its collector back.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def held():
    """No automatic collection inside the block; the collector's state before it comes back after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class StepCollector:
    """Collect every ``every`` steps of a loop, and only then (module doc). Call :meth:`step` at the same
    point of every rank's loop (after the step, which every rank leaves together)."""

    def __init__(self, every: int = 1):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"collect every N steps needs an integer N >= 1, got {every!r}")
        self.every = every
        self.steps = 0
        self._was = gc.isenabled()
        gc.collect()  # what setup left as garbage is freed now rather than frozen for the whole run
        gc.freeze()
        gc.disable()

    def step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            gc.collect()  # walks only what the loop allocated since the freeze

    def close(self) -> None:
        gc.unfreeze()
        if self._was:
            gc.enable()

    def __enter__(self) -> StepCollector:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
