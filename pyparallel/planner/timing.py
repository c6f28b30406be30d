"""Step time: compute from FLOPs, the pipeline bubble, and the part of communication not hidden.

FLOPs per token follow Narayanan et al. 2021 (appendix): 6Ψ for the matmuls with weights (forward 2Ψ,
backward 4Ψ) plus 12·L·h·s for attention scores and their weighted sum; full recompute reruns the
forward (×4/3, Korthikanti et al. 2022), selective recompute reruns only the attention core.
"""

from __future__ import annotations

import math

from pyparallel.planner.traffic import Phase


def model_flops_per_step(model, seq_len: int, tokens: int) -> float:
    """Model FLOPs of one step, (6Ψ + 12·L·h·s)·tokens; what MFU is measured against (no recompute)."""
    dense = 6.0 * model.num_params()
    attention = 12.0 * model.layers * model.hidden * seq_len if model.has_shape else 0.0
    return (dense + attention) * tokens


def hardware_flops_per_step(model, seq_len: int, tokens: int, recompute: str = "none") -> float:
    """FLOPs the GPUs execute: model FLOPs plus recomputation (of the transformer layers: the output
    layer is never checkpointed, as in Megatron-LM and Narayanan et al.'s eq. 3)."""
    flops = model_flops_per_step(model, seq_len, tokens)
    if recompute == "full":
        if not model.has_shape:
            return flops * 4.0 / 3.0  # one more forward (2 of every 6 units of work)
        layer_fwd = 2.0 * model.layers * model.layer_params() + 4.0 * model.layers * model.hidden * seq_len
        return flops + layer_fwd * tokens
    if recompute == "selective" and model.has_shape:
        return flops + 4.0 * model.layers * model.hidden * seq_len * tokens  # attention core forward
    return flops


def bubble_fraction(pp: int, num_microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1,
                    layers_per_stage: int | None = None) -> float:
    """Idle share of a pipelined step with equal forward, input-gradient and weight-gradient times:
    (p−1)/(m+p−1) times the schedule's bubble unit, 1 for GPipe and 1F1B (Huang et al. 2019; Narayanan et
    al. 2021). Interleaving with v chunks divides the bubble by v; when v does not divide the
    ``layers_per_stage`` n, the largest chunk of ⌈n/v⌉ layers paces it, dividing by n/⌈n/v⌉ instead.
    ZB-H1 leaves a third of 1F1B's bubble, ZB-V none (Qi et al. 2023; 2024). The step-time model
    (steptime.py) uses the actual F/B/W times instead of equal ones."""
    if pp <= 1:
        return 0.0
    m, p = num_microbatches, pp
    if schedule == "interleaved":
        v = virtual_stages
        if layers_per_stage:
            v = layers_per_stage / math.ceil(layers_per_stage / virtual_stages)
        unit = 1.0 / v
    else:
        unit = {"zb-h1": 1 / 3, "zbv": 0.0}.get(schedule, 1.0)
    return (p - 1) / (m + p - 1) * unit


def exposed_seconds(phase: Phase, bandwidth_gbs: float, window_s: float) -> float:
    """Time a phase adds to the step: its first chunk always waits (nothing to overlap it with yet);
    the rest hides behind ``window_s`` of compute and only the excess is exposed. Repeats (one per
    micro-batch) each get their own window."""
    bw = bandwidth_gbs * 1e9
    total = phase.bytes / bw
    if phase.overlap == "none":
        return total * phase.repeats
    chunk = min(phase.chunk_bytes / bw, total)
    return phase.repeats * (chunk + max(0.0, total - chunk - window_s))


def offload_seconds(shard_params: float, dtype_bytes: int, pcie_gbs: float, host_gbs: float,
                    ranks_per_node: int) -> dict[str, float]:
    """ZeRO-Offload (Ren et al. 2021) per step: gradients down and updated weights up over PCIe, and the
    CPU optimizer step, memory-bound at about 32 bytes per parameter (read p, m, v, g; write p, m, v and
    the 16-bit copy) on the host bandwidth each GPU's process gets. Not overlapped (no delayed update)."""
    pcie = 2 * shard_params * dtype_bytes / (pcie_gbs * 1e9)
    cpu_step = shard_params * 32 / (host_gbs * 1e9 / ranks_per_node)
    return {"pcie": pcie, "cpu_step": cpu_step, "total": pcie + cpu_step}


def mfu(model_flops: float, step_s: float, world: int, peak_flops: float) -> float:
    """Model FLOPs utilization (Chowdhery et al. 2022): model FLOPs per second over the cluster's peak."""
    return model_flops / (step_s * world * peak_flops) if step_s > 0 else 0.0
