"""Communication volume per step and per mesh axis.

Bytes are what one rank puts on the wire under ring algorithms, the bus-bandwidth convention of
nccl-tests that ``pyparallel.comm`` also counts ("wire bytes"): all-reduce 2(N−1)/N of the tensor,
all-gather and reduce-scatter (N−1)/N of the full tensor, point-to-point 1×. With ``ring=False`` the
functions return payload bytes (the tensor sizes handed to the collectives) instead.

Sources: DDP and ZeRO volumes from Rajbhandari et al. 2020 (section 7: stages 1–2 move 2Ψ per rank like
DDP, stage 3 moves 3Ψ); Megatron tensor parallelism from Shoeybi et al. 2019 (two all-reduces of
b·s·h per layer in forward, two in backward); pipeline point-to-point from Narayanan et al. 2021.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyparallel.planner.memory import DTYPE_BYTES, gathers_per_step, zero_stage_of


def ring_factor(op: str, n: int) -> float:
    """Share of the tensor each rank sends in a ring collective over ``n`` ranks."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "p2p":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class Phase:
    """One kind of collective in a step, repeated ``repeats`` times (e.g. once per micro-batch).

    ``overlap`` names the compute it can hide behind ("forward", "backward") or "none"; ``chunk_bytes``
    is the first piece that must finish before overlap can start (a bucket, one layer's weights).
    """

    name: str
    axis: str
    bytes: float  # per repeat, per rank
    repeats: int
    overlap: str
    chunk_bytes: float = 0.0

    @property
    def total(self) -> float:
        return self.bytes * self.repeats


def dp_phases(params_rank: float, zero_stage: int, dp: int, dtype: str = "bf16", num_microbatches: int = 1,
              bucket_bytes: float = 25 * 2**20, layer_params: float = 0.0, ring: bool = True,
              recompute: str = "none", pp: int = 1) -> list[Phase]:
    """Data-parallel traffic of one step for DDP or a ZeRO stage (Rajbhandari et al. 2020, section 7).

    Gradient accumulation over m micro-batches keeps DDP and ZeRO-1 at one reduction per step (their
    full-size gradients accumulate locally), whereas ZeRO-2 must reduce-scatter every micro-batch (each
    rank keeps only its shard) and ZeRO-3 must also re-gather the weights for every forward and
    backward, so their volume grows with m. Under full recompute ZeRO-3 gathers a third time, for the
    recomputed forward (module hooks fire again): 4Ψ per micro-batch instead of 3Ψ. Under a pipeline
    (``pp`` > 1, ``memory.gathers_per_step``) ZeRO-3 gathers the stage's weights once per step and
    reduce-scatter its accumulated gradients once: 2Ψ per step, whatever m and the recompute.
    """
    if dp <= 1:
        return []
    w = DTYPE_BYTES[dtype]
    m = num_microbatches

    def f(op):
        return ring_factor(op, dp) if ring else 1.0

    grads, weights = params_rank * w, params_rank * w
    if zero_stage == 0:
        return [Phase("grad all-reduce", "dp", f("all_reduce") * grads, 1, "backward", bucket_bytes)]
    gather = Phase("param all-gather", "dp", f("all_gather") * weights, 1, "none")
    if zero_stage == 1:
        return [Phase("grad reduce-scatter", "dp", f("reduce_scatter") * grads, 1, "backward", bucket_bytes),
                gather]
    if zero_stage == 2:
        return [Phase("grad reduce-scatter", "dp", f("reduce_scatter") * grads, m, "backward", bucket_bytes),
                gather]
    if gathers_per_step(zero_stage, dp, pp):
        return [Phase("param all-gather (once per step)", "dp", f("all_gather") * weights, 1, "none"),
                Phase("grad reduce-scatter", "dp", f("reduce_scatter") * grads, 1, "backward", bucket_bytes)]
    layer = layer_params * w
    first = f("all_gather") * layer  # the first layer's gather has nothing to hide behind
    out = [
        Phase("fwd param all-gather", "dp", f("all_gather") * weights, m, "forward", first),
        Phase("bwd param all-gather", "dp", f("all_gather") * weights, m, "backward", first),
        Phase("grad reduce-scatter", "dp", f("reduce_scatter") * grads, m, "backward", bucket_bytes),
    ]
    if recompute == "full":
        out.insert(1, Phase("recompute param all-gather", "dp", f("all_gather") * weights, m, "backward", first))
    return out


def tp_phase(stage_layers: int, seq_len: int, micro_batch: int, hidden: int, tp: int, num_microbatches: int,
             dtype: str = "bf16", recompute: str = "none", ring: bool = True) -> list[Phase]:
    """Megatron TP (Shoeybi et al. 2019): the f/g operators all-reduce b·s·h activations twice in forward
    and twice in backward per layer; full recompute reruns the forward, adding two more. Sequence
    parallelism replaces each all-reduce by an all-gather plus a reduce-scatter: the same bytes."""
    if tp <= 1:
        return []
    per_allreduce = micro_batch * seq_len * hidden * DTYPE_BYTES[dtype]
    count = 6 if recompute == "full" else 4
    factor = ring_factor("all_reduce", tp) if ring else 1.0
    return [Phase("activation all-reduce", "tp", factor * per_allreduce * count * stage_layers,
                  num_microbatches, "none")]


def pp_phase(seq_len: int, micro_batch: int, hidden: int, pp: int, num_microbatches: int, tp: int = 1,
             sequence_parallel: bool = False, dtype: str = "bf16", virtual_stages: int = 1) -> list[Phase]:
    """Pipeline point-to-point (Narayanan et al. 2021): an inner stage sends one b·s·h activation forward
    and one gradient backward per micro-batch (split by t under sequence parallelism); with v
    interleaved chunks every micro-batch crosses v times as many boundaries."""
    if pp <= 1:
        return []
    tensor = micro_batch * seq_len * hidden * DTYPE_BYTES[dtype] / (tp if sequence_parallel else 1)
    return [Phase("activation send/recv", "pp", 2 * tensor * virtual_stages, num_microbatches, "none")]


def comm_bytes_per_step(num_params: float, strategy: str | int = "ddp", dp: int = 1, dtype: str = "bf16",
                        num_microbatches: int = 1, tp: int = 1, pp: int = 1, layers: int = 0,
                        hidden: int = 0, seq_len: int = 0, micro_batch: int = 1, recompute: str = "none",
                        sequence_parallel: bool = False, ring: bool = True) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by axis: ``{"dp", "tp", "pp", "total"}``.

    ``num_params`` is the rank's parameter count before ZeRO sharding (the pipeline stage's share
    divided by tp). TP and PP terms need ``layers`` (the stage's layers for TP), ``hidden`` and
    ``seq_len``. For DDP and ZeRO-1/2 with one micro-batch the DP volume is 2Ψ·(N−1)/N elements per rank;
    ZeRO-3 moves 3Ψ·(N−1)/N.
    """
    stage = zero_stage_of(strategy)
    phases = dp_phases(num_params, stage, dp, dtype, num_microbatches, ring=ring, pp=pp)
    if tp > 1:
        phases += tp_phase(layers, seq_len, micro_batch, hidden, tp, num_microbatches, dtype, recompute, ring)
    if pp > 1:
        phases += pp_phase(seq_len, micro_batch, hidden, pp, num_microbatches, tp, sequence_parallel, dtype)
    return summarize(phases)


def summarize(phases: list[Phase]) -> dict[str, float]:
    out = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    for ph in phases:
        out[ph.axis] += ph.total
    out["total"] = out["dp"] + out["tp"] + out["pp"]
    return out


def spans_nodes(axis: str, dp: int, tp: int, pp: int, gpus_per_node: int) -> bool:
    """Whether a group of ``axis`` crosses a node boundary, with ranks laid out as in ParallelMesh:
    rank = pp_index·(dp·tp) + dp_index·tp + tp_index (TP innermost, as Megatron-LM orders its groups).
    A TP group is tp consecutive ranks, a DP group spans dp·tp consecutive ranks, and a pipeline
    crosses nodes (on at least one boundary, which then paces it) as soon as the whole job does. One
    straddling group is enough: the collective runs at its slowest link."""
    world = dp * tp * pp
    span = {"tp": tp, "dp": dp * tp, "pp": world}[axis]
    g = gpus_per_node
    return any(start // g != (start + span - 1) // g for start in range(0, world, span))
