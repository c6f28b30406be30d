"""The pipeline engine as the combined model uses it: every layout runs through ``PipelineParallel`` (one
stage when pp = 1), which provides micro-batching, the global-token loss pre-scaling and the schedules.

Two changes to the stand-alone engine, both because the DP engine now owns the gradients:

* the tied-weight all-reduce among stages is left to the DP engine, which does it on its own flat
  buffers (on 1/N of the tensor under ZeRO) instead of on ``.grad``, which stage 2 and bf16 runs do not
  keep;
* shape inference is re-run in the compute dtype after the DP engine has cast the weights (the engine
  checks each received activation's dtype against it).
"""

from __future__ import annotations

import torch

from pyparallel import materialize
from pyparallel.pipeline_parallel.engine import PipelineParallel


class StagePipeline(PipelineParallel):
    """``PipelineParallel`` whose tied gradients are reduced by the DP engine (see the module doc).

    ``source``: ``(reader, buffer names)`` from ``materialize.open_source``, opened by ``parallelize`` on the
    unsplit model; the stage then rebuilds its buffers and frozen parameters, and leaves its trainable ones on
    meta for the DP engine, which allocates only what its ZeRO stage keeps and loads them from the reader."""

    def __init__(self, *args, source=None, **kwargs):
        self._source = source or (None, set())
        super().__init__(*args, **kwargs)

    def _open_source(self, model, mesh, weights, init):
        return self._source

    def _materialize(self, model, reader, buffers) -> None:
        materialize.rebuild_buffers(model, self.mesh.device, buffers, only=self._local_modules())
        materialize.empty_like_meta([p for p in self.parameters() if not p.requires_grad], self.mesh.device)

    def _reduce_tied(self) -> None:
        return None  # ShardEngine.finish_reductions sums tied weights over their stages, on its own buffers

    def tie_groups(self) -> dict[int, tuple]:
        """id(parameter) -> (group, pipeline stages holding it) for this rank's cross-stage tied weights."""
        out = {}
        for prm, group in self._tied:
            stages = tuple(sorted(self.mesh.coords_of(r).pp for r in group.ranks))
            out[id(prm)] = (group, stages)
        return out

    def retype(self, dtype: torch.dtype) -> None:
        """Re-derive the boundary shapes/dtypes for weights cast to ``dtype``."""
        for block in self._meta_blocks:
            for prm in block.parameters():
                if prm.is_floating_point() and prm.dtype != dtype:
                    prm.data = torch.empty_like(prm.data, dtype=dtype, device="meta")
        self._shapes.clear()
