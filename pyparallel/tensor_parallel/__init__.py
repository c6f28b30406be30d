"""Megatron-style tensor parallelism (Shoeybi et al. 2019) with optional sequence parallelism
(Korthikanti et al. 2022): the f/g mappings, parallel layers, vocabulary-parallel cross-entropy, and
``parallelize`` for drop-in replacement of a model's layers. See docs/tensor_parallel.md."""

from pyparallel.tensor_parallel.blocks import ParallelMLP, ParallelSelfAttention
from pyparallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from pyparallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    InputCache,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pyparallel.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from pyparallel.tensor_parallel.parallelize import causal_lm_loss, full_parameters, parallelize
from pyparallel.tensor_parallel.plans import GPT2_PLAN, GPT_PLAN, LLAMA_PLAN

__all__ = [
    "GPT2_PLAN",
    "GPT_PLAN",
    "LLAMA_PLAN",
    "ColumnParallelLinear",
    "InputCache",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "causal_lm_loss",
    "copy_to_tp",
    "full_parameters",
    "gather_from_sequence",
    "gather_from_tp",
    "parallelize",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "scatter_to_tp",
    "vocab_parallel_cross_entropy",
]
