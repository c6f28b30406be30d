"""Pipeline parallelism: split a model into stages, run micro-batches through them with GPipe, 1F1B or
interleaved 1F1B, and measure the bubble. See docs/pipeline.md."""

from pyparallel.pipeline_parallel.engine import PipelineParallel
from pyparallel.pipeline_parallel.partition import balance, to_blocks, token_cross_entropy
from pyparallel.pipeline_parallel.schedules import SCHEDULES, theoretical_bubble
from pyparallel.pipeline_parallel.stats import SavedTensorMeter

__all__ = ["SCHEDULES", "PipelineParallel", "SavedTensorMeter", "balance", "theoretical_bubble",
           "to_blocks", "token_cross_entropy"]
