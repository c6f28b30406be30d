"""Step time of one configuration: what runs on the critical path, and what overlaps with what.

The step of the slowest pipeline stage is m micro-batches of forward + backward, plus the schedule's
bubble, plus what the data-parallel axis and the optimizer add once per step:

- **Tensor parallelism** (Shoeybi et al. 2019; Korthikanti et al. 2022): two all-reduces of b·s·h per
  layer in forward, two in backward, two more under full recompute (sequence parallelism: a
  reduce-scatter plus an all-gather each, the same bytes). Forward ones are on the critical path; in
  backward each column-parallel layer's input-gradient all-reduce overlaps its weight-gradient GEMM
  (Megatron-LM's asynchronous all-reduce), so only the excess is exposed.
- **Pipeline** (Narayanan et al. 2021): each micro-batch sends one activation forward and one gradient
  back per chunk boundary, on the critical path; with tp > 1 the scatter/gather optimization sends 1/t of
  it across nodes per rank and all-gathers it over NVLink. Bubble: the fill and drain through the p−1
  stages other than the slowest, each at its own time per micro-batch, for GPipe and 1F1B; interleaved
  with v chunks, each stage's share times ⌈n/v⌉/n for its n layers (uneven chunks pay for the largest
  one); ZB-H1 (p−1)(T_F + T_B − T_W) and ZB-V (p−1)(T_F + T_B −
  2T_W)/2 from the split backward (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", and 2024).
- **ZeRO-3** (Rajbhandari et al. 2020): per unit (one layer) and micro-batch an all-gather before its
  forward, one before its backward (two under full recompute: the recomputed forward gathers again, as a
  module-hook engine such as DeepSpeed's does), a reduce-scatter after it. With one unit prefetched, a
  unit's gathers run under the previous unit's compute: the longer of the two paces the unit. The first
  unit's gather waits. Under a pipeline pyparallel gathers a stage once per step instead, which costs
  what ZeRO-1 costs (see ``dp_seconds``).
- **DDP / ZeRO-1 / ZeRO-2** (Li et al. 2020, "PyTorch Distributed"): where the engine reduces bucket by
  bucket during backward, the reduction runs under the backward of the last micro-batch (ZeRO-2: of every
  micro-batch); only the last bucket and what outlasts the backward are exposed. Under a pipeline, and
  under ``parallelize`` with tensor parallelism and several micro-batches, the gradients are reduced once
  the step's micro-batches are done (``ShardEngine.finish_reductions``; ``engine.sync`` is set only for
  one stage and one micro-batch), so the whole reduction is on the critical path -- as in the runs of
  Narayanan et al. 2021, whose data-parallel all-reduce followed the pipeline flush. ZeRO-1/2 all-gather
  the updated weights after the step (exposed).
- **Overlap is not free**: a collective running beside compute takes SMs and memory bandwidth from it.
  Overlapped, compute of c seconds beside a collective of x seconds takes max(c + κ·x, x), with one
  global κ (``OVERLAP_CONTENTION``) fitted to Narayanan et al.'s ZeRO-3 rows (table 2).
- **Optimizer** (memory-bound, on the GPU) and **offload** (ZeRO-Offload, Ren et al. 2021: gradients down
  and weights up over PCIe, the CPU Adam on the node's share of host bandwidth), not overlapped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyparallel.planner import compute as cmod
from pyparallel.planner.memory import DTYPE_BYTES, gathers_per_step
from pyparallel.planner.traffic import ring_factor

# Fitted once, globally, to Narayanan et al. 2021 table 2 (ZeRO-3 at 384 to 2240 GPUs): a third of an
# overlapped collective's duration is lost by the compute beside it (docs/planner.md, "Calibration").
OVERLAP_CONTENTION = 1 / 3


def overlapped(compute_s: float, comm_s: float, kappa: float | None = None) -> float:
    """Seconds added to ``compute_s`` by a collective of ``comm_s`` running beside it."""
    if comm_s <= 0:
        return 0.0
    kappa = OVERLAP_CONTENTION if kappa is None else kappa
    return max(kappa * comm_s, comm_s - compute_s)


@dataclass(frozen=True)
class Layout:
    """One configuration's choices (the search varies every field)."""

    dp: int
    tp: int
    pp: int
    zero: int
    offload: bool
    micro_batch: int
    num_microbatches: int
    recompute: str
    sequence_parallel: bool
    schedule: str
    virtual_stages: int


@dataclass(frozen=True)
class Bandwidths:
    dp: float
    tp: float
    pp: float
    intra: float


def _tp_seconds(lay: Layout, model, seq_len: int, dtype: str, bw: Bandwidths, lt) -> tuple[float, float]:
    """Exposed TP all-reduce seconds per layer per micro-batch: (forward incl. recompute, backward)."""
    if lay.tp <= 1:
        return 0.0, 0.0
    tensor = lay.micro_batch * seq_len * model.hidden * DTYPE_BYTES[dtype]
    one = ring_factor("all_reduce", lay.tp) * tensor / (bw.tp * 1e9)
    fwd = 2 * one * (2 if lay.recompute == "full" else 1)
    # Backward: the input-gradient all-reduces of QKV and the MLP up projection each hide behind half of
    # the layer's weight-gradient GEMMs.
    bwd = 2 * overlapped(lt.w / 2, one)
    return fwd, bwd


def _p2p_seconds(lay: Layout, model, seq_len: int, dtype: str, bw: Bandwidths) -> float:
    """Pipeline send/recv seconds per micro-batch on a stage's critical path (both directions, v chunks)."""
    if lay.pp <= 1:
        return 0.0
    tensor = lay.micro_batch * seq_len * model.hidden * DTYPE_BYTES[dtype]
    one = tensor / lay.tp / (bw.pp * 1e9)
    if lay.tp > 1 and not lay.sequence_parallel:  # scatter/gather: re-assemble the full tensor over NVLink
        one += ring_factor("all_gather", lay.tp) * tensor / (bw.intra * 1e9)
    return 2 * one * lay.virtual_stages


def _zero3_seconds(lay: Layout, unit_params: float, bw: Bandwidths, dtype: str, fwd: float,
                   bwd: float) -> float:
    """ZeRO-3 exposure for one unit and one micro-batch, its compute being ``fwd`` and ``bwd`` seconds."""
    if lay.zero != 3 or lay.dp <= 1 or gathers_per_step(lay.zero, lay.dp, lay.pp):
        return 0.0
    gather = ring_factor("all_gather", lay.dp) * unit_params * DTYPE_BYTES[dtype] / (bw.dp * 1e9)
    gathers_bwd = 2 if lay.recompute == "full" else 1
    return overlapped(fwd, gather) + overlapped(bwd, (gathers_bwd + 1) * gather)


def _bubble_units(schedule: str, layers: int, v: int, f: float, b: float, w: float) -> float:
    """Bubble seconds per (p − 1) for a stage whose micro-batch takes f (forward), b (input gradient and
    recompute) and w (weight gradient) seconds."""
    whole = f + b + w
    if schedule == "interleaved" and layers > 0:
        return whole * math.ceil(layers / v) / layers
    if schedule == "zb-h1":
        return max(0.0, f + b - w)
    if schedule == "zbv":
        return max(0.0, f + b - 2 * w) / 2
    return whole


@dataclass
class StageTimes:
    f: float = 0.0
    b: float = 0.0
    w: float = 0.0
    compute: float = 0.0  # per micro-batch, compute only
    tp: float = 0.0  # per micro-batch exposed TP communication
    pp: float = 0.0
    zero3: float = 0.0

    @property
    def per_microbatch(self) -> float:
        return self.f + self.b + self.w


def stage_times(cm, lay: Layout, model, seq_len: int, dtype: str, bw: Bandwidths, layers: int,
                first: bool, last: bool, unit_params: float, embed_params: float) -> StageTimes:
    """Per-micro-batch times of one pipeline stage holding ``layers`` layers."""
    lt = cmod.layer_times(cm, model, seq_len, lay.micro_batch, lay.tp, lay.sequence_parallel, lay.recompute,
                          dtype)
    tp_f, tp_b = _tp_seconds(lay, model, seq_len, dtype, bw, lt)
    st = StageTimes()
    st.f = layers * (lt.f + tp_f)
    st.b = layers * (lt.b_in + lt.r + tp_b)
    st.w = layers * lt.w
    st.compute = layers * lt.total
    st.tp = layers * (tp_f + tp_b)
    head = cmod.head_times(cm, model, seq_len, lay.micro_batch, lay.tp, dtype) if last else None
    if head is not None:
        st.f, st.b, st.w = st.f + head.f, st.b + head.b_in, st.w + head.w
        st.compute += head.total
    z3 = layers * _zero3_seconds(lay, unit_params, bw, dtype, lt.f, lt.b_in + lt.r + lt.w)
    if lay.zero == 3 and lay.dp > 1 and not gathers_per_step(lay.zero, lay.dp, lay.pp):
        first_gather = ring_factor("all_gather", lay.dp) * unit_params * DTYPE_BYTES[dtype] / (bw.dp * 1e9)
        embed = _zero3_seconds(lay, embed_params, bw, dtype, head.f if head else 0.0,
                               head.b_in + head.w if head else 0.0) if (first or last) else 0.0
        z3 += first_gather + embed
    st.zero3 = z3
    st.pp = _p2p_seconds(lay, model, seq_len, dtype, bw)
    st.b += z3 + st.pp  # exposed per micro-batch, on the stage's critical path
    return st


def pipeline_seconds(lay: Layout, stages: list[tuple[StageTimes, int, int]]) -> tuple[float, float]:
    """(m micro-batches on the slowest stage, the bubble) in seconds; ``stages``: (times, layers, how many
    stages are like it), the counts summing to p.

    A flushed pipeline whose stages take t_j per micro-batch runs m·max t_j on its slowest stage, plus the
    fill and drain through every other stage: the first micro-batch's forward reaches the slowest stage,
    and the last one's backward leaves it, through the others, each at its own speed. With equal stages
    that is Narayanan et al.'s (p − 1)(t_f + t_b); the output layer on the last stage (or an extra layer
    where p does not divide L) makes that stage the slowest without lengthening the others' share of
    the fill and drain. Each stage's share is scaled by the schedule (``_bubble_units``)."""
    slowest = max((st for st, _, _ in stages), key=lambda t: t.per_microbatch)
    busy = lay.num_microbatches * slowest.per_microbatch
    if lay.pp <= 1:
        return busy, 0.0
    units = [(_bubble_units(lay.schedule, n, lay.virtual_stages, st.f, st.b, st.w), count, st is slowest)
             for st, n, count in stages]
    bubble = sum(unit * (count - 1 if is_slowest else count) for unit, count, is_slowest in units)
    return busy, bubble


def reduces_in_backward(lay: Layout) -> bool:
    """Whether the gradient reduction runs bucket by bucket inside backward, as pyparallel's engines do
    it: ZeRO-2 in every micro-batch; DDP, ZeRO-1 and ZeRO-3 (gathered per step) only without a pipeline,
    and, with tensor parallelism (``parallelize``), only for a single micro-batch. Without TP and PP
    (``DataParallel`` / ``zero.setup``), ``no_sync`` defers the earlier micro-batches and the last one's
    backward carries the reduction. Otherwise ``parallelize`` reduces after the last micro-batch."""
    if lay.zero == 2:
        return True
    return lay.pp == 1 and (lay.tp == 1 or lay.num_microbatches == 1)


def dp_seconds(lay: Layout, params_rank: float, bw: Bandwidths, dtype: str, bucket_bytes: float,
               backward_s: float) -> dict[str, float]:
    """Exposed data-parallel seconds once per step for DDP, ZeRO-1 and ZeRO-2 (ZeRO-3's are per unit), and
    ZeRO-3 under a pipeline, which moves what ZeRO-1 does: its gather of the stage's weights before the
    first micro-batch waits as ZeRO-1's after the step does, and its one reduce-scatter, after the last
    micro-batch, as ZeRO-1's does.

    ``backward_s``: one micro-batch's backward on the stage, the window the gradient buckets hide in
    where the engine reduces during backward (``reduces_in_backward``); otherwise all of it is exposed."""
    out = {"grad": 0.0, "gather": 0.0}
    stage = 1 if gathers_per_step(lay.zero, lay.dp, lay.pp) else lay.zero
    if lay.dp <= 1 or stage == 3:
        return out
    w = DTYPE_BYTES[dtype]
    op = "all_reduce" if stage == 0 else "reduce_scatter"
    total = ring_factor(op, lay.dp) * params_rank * w / (bw.dp * 1e9)
    last = ring_factor(op, lay.dp) * min(bucket_bytes, params_rank * w) / (bw.dp * 1e9)
    hidden = overlapped(backward_s, total - last) + last if reduces_in_backward(lay) else total
    repeats = lay.num_microbatches if stage == 2 else 1
    out["grad"] = repeats * hidden
    if stage in (1, 2):
        out["gather"] = ring_factor("all_gather", lay.dp) * params_rank * w / (bw.dp * 1e9)
    return out
