"""The planner: predict per-GPU memory, traffic and step time of a parallel layout, and search for the
best one (``pyparallel plan``). Pure Python; never imports torch.

Formulas: model states from ZeRO (Rajbhandari et al. 2020), activations from Korthikanti et al. 2022,
tensor-parallel traffic from Megatron-LM (Shoeybi et al. 2019), the pipeline bubble and FLOP counts from
Narayanan et al. 2021. See docs/planner.md.
"""

from pyparallel.planner.errors import PlanError
from pyparallel.planner.memory import (
    activation_bytes,
    activation_bytes_per_layer,
    in_flight_microbatches,
    model_state_bytes,
    state_bytes_per_param,
)
from pyparallel.planner.recommend import Plan, plan
from pyparallel.planner.search import Candidate, SearchOptions, evaluate
from pyparallel.planner.specs import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    ModelSpec,
    TrainSpec,
    load_hf_config,
    resolve_cluster,
    resolve_model,
)
from pyparallel.planner.timing import bubble_fraction, hardware_flops_per_step, model_flops_per_step
from pyparallel.planner.traffic import comm_bytes_per_step, ring_factor

__all__ = [
    "CLUSTER_PRESETS",
    "MODEL_PRESETS",
    "Candidate",
    "ClusterSpec",
    "ModelSpec",
    "Plan",
    "PlanError",
    "SearchOptions",
    "TrainSpec",
    "activation_bytes",
    "activation_bytes_per_layer",
    "bubble_fraction",
    "comm_bytes_per_step",
    "evaluate",
    "hardware_flops_per_step",
    "in_flight_microbatches",
    "load_hf_config",
    "model_flops_per_step",
    "model_state_bytes",
    "plan",
    "resolve_cluster",
    "resolve_model",
    "ring_factor",
    "state_bytes_per_param",
]
