"""Evaluate one layout, and search every DP × TP × PP layout, ZeRO stage, offload and micro-batch size.

A candidate's memory is that of its fullest pipeline stage; its step time is compute stretched by the
pipeline bubble plus whatever communication cannot hide behind compute (see timing.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pyparallel.planner import memory as mem
from pyparallel.planner import steptime, timing, traffic
from pyparallel.planner.compute import ComputeModel
from pyparallel.planner.specs import ClusterSpec, ModelSpec, TrainSpec


@dataclass(frozen=True)
class SearchOptions:
    """What the search may vary. None for ``tp``/``pp``/``dp`` means "search it"."""

    gpus: int
    allow_cross_node_tp: bool = False
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offload: str = "auto"  # auto: try both; on: only offloaded ZeRO; off: never
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None


@dataclass(frozen=True)
class Problem:
    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec
    options: SearchOptions

    @property
    def usable_bytes(self) -> float:
        return self.cluster.memory_gb * 1e9 * (1 - self.train.margin)


@dataclass
class Candidate:
    dp: int
    tp: int
    pp: int
    zero_stage: int
    offload: bool
    micro_batch: int
    num_microbatches: int
    memory_bytes: dict
    cpu_bytes: float
    fits: bool
    comm_bytes: dict
    exposed_s: dict
    bubble_fraction: float
    compute_s: float
    step_time_s: float
    mfu: float
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "none"
    virtual_stages: int = 1
    host_bytes_per_node: float = 0.0
    detail: dict = field(default_factory=dict, repr=False)

    @property
    def comm_bytes_per_step(self) -> float:
        return self.comm_bytes["total"]

    @property
    def strategy(self) -> tuple:
        return (self.dp, self.tp, self.pp, self.zero_stage, self.offload)

    def label(self) -> str:
        zero = "DDP" if self.zero_stage == 0 else f"ZeRO-{self.zero_stage}"
        off = " + offload" if self.offload else ""
        sp = " + SP" if self.sequence_parallel else ""
        sched = ""
        if self.pp > 1:
            sched = f", {self.schedule}" + (f" v={self.virtual_stages}" if self.schedule == "interleaved" else "")
        return (f"DP {self.dp} × TP {self.tp}{sp} × PP {self.pp}, {zero}{off}, "
                f"micro-batch {self.micro_batch} × {self.num_microbatches}, recompute {self.recompute}{sched}")

    def to_dict(self) -> dict:
        memory = {k: int(round(v)) for k, v in self.memory_bytes.items() if k != "total"}
        memory["total"] = sum(memory.values())  # exactly the sum of the rounded parts
        return {
            "dp": self.dp, "tp": self.tp, "pp": self.pp, "zero_stage": self.zero_stage,
            "offload": self.offload, "micro_batch": self.micro_batch,
            "num_microbatches": self.num_microbatches,
            "memory_bytes": memory,
            "cpu_bytes": int(round(self.cpu_bytes)), "fits": self.fits,
            "comm_bytes_per_step": int(round(self.comm_bytes_per_step)),
            "comm_bytes_by_axis": {k: int(round(self.comm_bytes[k])) for k in ("dp", "tp", "pp")},
            "exposed_comm_s": {k: round(v, 6) for k, v in self.exposed_s.items()},
            "bubble_fraction": round(self.bubble_fraction, 6), "compute_s": round(self.compute_s, 6),
            "step_time_s": round(self.step_time_s, 6), "mfu": round(self.mfu, 6),
            "recompute": self.recompute, "sequence_parallel": self.sequence_parallel,
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "host_bytes_per_node": int(round(self.host_bytes_per_node)),
        }


def stage_layers(layers: int, pp: int, stage: int) -> int:
    """Layers on ``stage``; when p does not divide L the last L mod p stages take one more (they hold
    fewer micro-batches of activations under 1F1B than the first)."""
    extra = layers % pp
    return layers // pp + (1 if stage >= pp - extra else 0)


def stage_first_layer(layers: int, pp: int, stage: int) -> int:
    """Index of ``stage``'s first layer (stages hold contiguous layers, :func:`stage_layers` of them)."""
    return sum(stage_layers(layers, pp, s) for s in range(stage))


def stage_params(model: ModelSpec, pp: int, stage: int) -> int:
    """Parameters on a pipeline stage: its layers (counted per layer where the model was: a mixture of
    experts' dense first layers make its first stage lighter), the embeddings on the first, the final norm
    and head on the last (a tied head is a second copy of the embedding there, as in Megatron-LM)."""
    if not model.has_shape:
        return model.num_params()
    first = stage_first_layer(model.layers, pp, stage)
    n = model.layers_params(first, first + stage_layers(model.layers, pp, stage))
    if stage == 0:
        n += model.embedding_params()
    if stage == pp - 1:
        n += model.head_params() + (model.vocab * model.hidden if model.tied and pp > 1 else 0)
    return n


def _stage_memory(pb: Problem, lay, stage) -> dict:
    model, tr = pb.model, pb.train
    dp, tp, pp, mb, m = lay.dp, lay.tp, lay.pp, lay.micro_batch, lay.num_microbatches
    layers = stage_layers(model.layers, pp, stage) if model.has_shape else 0
    params_rank = stage_params(model, pp, stage) / tp
    states = mem.model_state_bytes(params_rank, lay.zero, dp, tr.dtype, tr.optimizer, lay.offload)
    kept = effective_recompute(model, lay.recompute)
    act = mem.stage_activation_bytes(model, tr.seq_len, mb, tp, pp, stage, layers, m, lay.schedule,
                                     lay.virtual_stages, lay.sequence_parallel, kept, tr.dtype)
    p2p = mb * tr.seq_len * model.hidden * mem.DTYPE_BYTES[tr.dtype] / (tp if lay.sequence_parallel else 1)
    unit = unit_params(model) / tp
    buffers = mem.buffer_bytes(params_rank, unit, lay.zero, dp, tr.dtype, tr.bucket_mb, p2p, pp)
    memory = {"params": states["params"], "grads": states["grads"],
              "optimizer": states["optimizer"] + states["master"], "activations": act["total"],
              "buffers": buffers}
    memory["total"] = sum(memory.values())
    host = mem.host_bytes_per_rank(params_rank, lay.zero, dp, tr.dtype, tr.optimizer, lay.offload)
    return {"stage": stage, "layers": layers, "params_rank": params_rank, "memory": memory,
            "cpu": states["cpu"], "host": host, "act": act, "layer_rank": unit}


def effective_recompute(model: ModelSpec, recompute: str) -> str:
    """Fused attention stores no s×s scores even without recomputation: Korthikanti's selective case."""
    if recompute == "none" and model.fused_attention:
        return "selective"
    return recompute


def unit_params(model: ModelSpec) -> float:
    """Parameters of ZeRO-3's largest gathered unit: a layer or the embedding, whichever is larger. With
    only a parameter count, the layer of a transformer of typical aspect (Ψ ≈ 12·L·h² with L ≈ h/128, as
    GPT-3's 175B has): h = (128·Ψ/12)^(1/3), 12·h² parameters per layer."""
    if model.has_shape:
        return float(max(model.max_layer_params(), model.embedding_params()))
    h = (128 * model.num_params() / 12) ** (1 / 3)
    return 12 * h * h


def _bandwidths(cl: ClusterSpec, dp: int, tp: int, pp: int) -> steptime.Bandwidths:
    bw = {axis: cl.inter_bw if traffic.spans_nodes(axis, dp, tp, pp, cl.gpus_per_node) else cl.intra_bw
          for axis in ("dp", "tp", "pp")}
    return steptime.Bandwidths(dp=bw["dp"], tp=bw["tp"], pp=bw["pp"], intra=cl.intra_bw)


def _params_only_seconds(cm, pb: Problem, lay) -> float:
    """Compute of a model known by its parameter count: 6Ψ FLOPs per token at the curve's ceiling."""
    tokens = pb.train.tokens / lay.dp
    return cm.gemm(6.0 * pb.model.num_params() * tokens / (lay.tp * lay.pp))


def evaluate(pb: Problem, dp: int, tp: int, pp: int, zero: int, offload: bool, mb: int, m: int,
             recompute: str | None = None, sequence_parallel: bool | None = None, schedule: str | None = None,
             virtual_stages: int | None = None) -> Candidate:
    """Memory, traffic and step time of one configuration (choices left None come from the TrainSpec;
    its "auto" recompute means the cheapest that fits, an unset sequence parallelism means off)."""
    model, tr, cl = pb.model, pb.train, pb.cluster
    rc = recompute or tr.recompute
    if rc == "auto":
        return cheapest_fit([evaluate(pb, dp, tp, pp, zero, offload, mb, m, r, sequence_parallel, schedule,
                                      virtual_stages) for r in recompute_options(model)])
    sp = bool(tr.sequence_parallel if sequence_parallel is None else sequence_parallel) and tp > 1
    sched = schedule or tr.schedule
    v = virtual_stages or tr.virtual_stages or 2
    v = v if sched == "interleaved" else 1
    lay = steptime.Layout(dp, tp, pp, zero, offload, mb, m, rc, sp, sched, v)
    world = dp * tp * pp
    stages = {0, pp - 1}
    if model.has_shape and model.layers % pp:
        stages.add(pp - model.layers % pp)  # the first stage given an extra layer
    per_stage = [_stage_memory(pb, lay, st) for st in sorted(stages)]
    worst = max(per_stage, key=lambda d: d["memory"]["total"])
    params_rank = max(d["params_rank"] for d in per_stage)
    max_layers = max(d["layers"] for d in per_stage)
    bw = _bandwidths(cl, dp, tp, pp)
    cm = ComputeModel.for_cluster(cl, tr.dtype, tr.efficiency)

    if model.has_shape:
        embed = model.embedding_params() / tp
        times = [steptime.stage_times(cm, lay, model, tr.seq_len, tr.dtype, bw, d["layers"], d["stage"] == 0,
                                      d["stage"] == pp - 1, d["layer_rank"], embed) for d in per_stage]
        slowest = max(times, key=lambda t: t.per_microbatch)
        busy, bubble_s = steptime.pipeline_seconds(lay, _stage_classes(model, pp, per_stage, times))
        compute_s = m * slowest.compute
        exposed_tp, exposed_pp, exposed_z3 = m * slowest.tp, m * slowest.pp, m * slowest.zero3
        backward_s = slowest.b + slowest.w
    else:
        compute_s = busy = _params_only_seconds(cm, pb, lay)
        bubble_s = exposed_tp = exposed_pp = 0.0
        exposed_z3 = 0.0
        backward_s = compute_s * 2 / 3 / m
        # no shape: the whole model as units, 3 (4 under full recompute) gathers per micro-batch
        if zero == 3 and dp > 1 and not mem.gathers_per_step(zero, dp, pp):
            gather = traffic.ring_factor("all_gather", dp) * params_rank * mem.DTYPE_BYTES[tr.dtype] / (bw.dp * 1e9)
            gathers = 4 if rc == "full" else 3
            exposed_z3 = m * (steptime.overlapped(compute_s / m / 3, gather) +
                              steptime.overlapped(compute_s / m * 2 / 3, (gathers - 1) * gather))
            busy += exposed_z3
    dp_s = steptime.dp_seconds(lay, params_rank, bw, tr.dtype, tr.bucket_mb * 2**20, backward_s)
    shard = params_rank / dp if zero >= 1 else params_rank
    off = None
    exposed = {"dp": dp_s["grad"] + dp_s["gather"] + exposed_z3, "tp": exposed_tp, "pp": exposed_pp,
               "offload": 0.0, "optimizer": 0.0}
    if offload:
        off = timing.offload_seconds(shard, mem.DTYPE_BYTES[tr.dtype], cl.pcie_bw, cl.host_bw,
                                     min(cl.gpus_per_node, world))
        exposed["offload"] = off["total"]
    else:
        exposed["optimizer"] = compute_optimizer_seconds(cm, shard, tr.dtype)
    step = busy + bubble_s + dp_s["grad"] + dp_s["gather"] + exposed["offload"] + exposed["optimizer"]
    bubble = bubble_s / (busy + bubble_s) if busy + bubble_s > 0 else 0.0

    phases = traffic.dp_phases(params_rank, zero, dp, tr.dtype, m, tr.bucket_mb * 2**20, worst["layer_rank"],
                               recompute=rc, pp=pp)
    if model.has_shape:
        phases += traffic.tp_phase(max_layers, tr.seq_len, mb, model.hidden, tp, m, tr.dtype, rc)
        phases += traffic.pp_phase(tr.seq_len, mb, model.hidden, pp, m, tp, sp, tr.dtype, v)
    peak = cl.peak_flops(tr.dtype)
    hw_flops = timing.hardware_flops_per_step(model, tr.seq_len, tr.tokens, effective_recompute(model, rc)
                                              if model.fused_attention else rc)
    model_flops = timing.model_flops_per_step(model, tr.seq_len, tr.tokens)
    ranks_per_node = min(cl.gpus_per_node, world)
    return Candidate(
        dp=dp, tp=tp, pp=pp, zero_stage=zero, offload=offload, micro_batch=mb, num_microbatches=m,
        memory_bytes=worst["memory"], cpu_bytes=worst["cpu"],
        fits=worst["memory"]["total"] <= pb.usable_bytes and _host_fits(pb, worst["host"] * ranks_per_node),
        comm_bytes=traffic.summarize(phases), exposed_s=exposed, bubble_fraction=bubble, compute_s=compute_s,
        step_time_s=step, mfu=timing.mfu(model_flops, step, world, peak),
        recompute=rc, sequence_parallel=sp, schedule=sched if pp > 1 else "none", virtual_stages=v,
        host_bytes_per_node=worst["host"] * ranks_per_node,
        detail={"worst": worst, "phases": phases, "bandwidth": {"dp": bw.dp, "tp": bw.tp, "pp": bw.pp},
                "hw_flops": hw_flops, "model_flops": model_flops, "peak": peak, "bubble_s": bubble_s,
                "busy_s": busy, "offload": off, "world": world, "compute_model": cm,
                "attention": "fused" if model.fused_attention else "unfused"},
    )


def _stage_classes(model: ModelSpec, pp: int, per_stage: list[dict], times: list) -> list[tuple]:
    """(times, layers, count) for the p stages from the evaluated ones: stage 0 stands for the stages of
    L // p layers, stage p − (L mod p) for those with one more (the last excepted), the last for itself."""
    by_stage = {d["stage"]: (t, d["layers"]) for d, t in zip(per_stage, times)}
    if pp == 1:
        return [(*by_stage[0], 1)]
    extra = model.layers % pp
    out = [(*by_stage[0], pp - extra - (1 if extra == 0 else 0))]
    if extra >= 2:
        out.append((*by_stage[pp - extra], extra - 1))
    out.append((*by_stage[pp - 1], 1))
    return [c for c in out if c[2] > 0]


def compute_optimizer_seconds(cm, shard: float, dtype: str) -> float:
    from pyparallel.planner.compute import optimizer_seconds

    return optimizer_seconds(cm, shard, dtype)


def _host_fits(pb: Problem, host_bytes_per_node: float) -> bool:
    ram = pb.cluster.host_ram_gb * 1e9
    return ram <= 0 or host_bytes_per_node <= ram * (1 - pb.train.margin)


def recompute_options(model: ModelSpec) -> tuple[str, ...]:
    """Cheapest first. With fused attention "none" and "selective" keep the same activations (the kernel
    recomputes the scores itself), so only selective and full remain."""
    return ("selective", "full") if model.fused_attention else ("none", "selective", "full")


def cheapest_fit(cands: list[Candidate]) -> Candidate:
    """The first candidate (cheapest recomputation) that fits, else the one needing the least memory."""
    for c in cands:
        if c.fits:
            return c
    return min(cands, key=lambda c: c.memory_bytes["total"])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_problem(pb: Problem, tp: int) -> str | None:
    model, g = pb.model, pb.cluster.gpus_per_node
    if tp == 1:
        return None
    if not model.has_shape:
        return "tensor parallelism needs the layer shapes (give --model or --layers/--hidden/--heads)"
    if g % tp and not pb.options.allow_cross_node_tp:
        return (f"tp {tp} does not divide the {g} GPUs per node (TP stays inside a node unless "
                f"--allow-cross-node-tp)")
    for what, n in (("hidden size", model.hidden), ("attention heads", model.heads),
                    ("key/value heads", model.kv), ("FFN size", model.ffn_dim)):
        if n % tp:
            return f"tp {tp} does not divide the {n} {what}"
    return None


def _pp_problem(pb: Problem, pp: int, dp: int) -> str | None:
    model, tr = pb.model, pb.train
    if pp > 1 and not model.has_shape:
        return "pipeline parallelism needs the layer shapes (give --model or --layers/--hidden/--heads)"
    if model.has_shape and pp > model.layers:
        return f"pp {pp} exceeds the {model.layers} layers"
    if tr.global_batch % dp:
        return f"global batch {tr.global_batch} is not divisible by dp {dp}"
    return None


def _micro_batches(pb: Problem, dp: int, pp: int) -> list[tuple[int, int]]:
    """(micro_batch, num_microbatches) pairs for a layout; pipelines need m >= p (and m a multiple of p
    for the interleaved schedule, as Megatron-LM requires)."""
    per_rank = pb.train.global_batch // dp
    if pb.train.micro_batch:
        sizes = [pb.train.micro_batch] if per_rank % pb.train.micro_batch == 0 else []
    else:
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= per_rank and per_rank % b == 0]
    out = []
    for b in sizes:
        m = per_rank // b
        if pp > 1 and (m < pp or (pb.train.schedule == "interleaved" and m % pp)):
            continue
        out.append((b, m))
    return out


def _micro_batch_problem(pb: Problem, dp: int, pp: int) -> str:
    per_rank, mb = pb.train.global_batch // dp, pb.train.micro_batch
    if mb and per_rank % mb:
        return f"--micro-batch {mb} does not divide the {per_rank} sequences per data-parallel rank"
    return (f"{per_rank} sequences per data-parallel rank make fewer than the {pp} micro-batches a "
            f"{pp}-stage pipeline needs" + (" (or not a multiple of it)" if pb.train.schedule == "interleaved"
                                              else ""))


def _modes(pb: Problem, dp: int, pp: int) -> list[tuple[int, bool]]:
    """(ZeRO stage, offload) pairs worth evaluating for a layout; every stage combines with TP and PP
    (under a pipeline ZeRO-2 reduce-scatters once per micro-batch, ZeRO-3 gathers the stage once per step,
    as ``pyparallel.parallelize`` does: the memory and time models charge each)."""
    out = []
    for z in pb.options.zero_stages:
        offloads = {"auto": (False, True), "off": (False,), "on": (True,)}[pb.options.offload]
        out += [(z, o) for o in offloads if not (o and z == 0)]
    if dp > 1:
        return out
    # With one data-parallel rank ZeRO has nothing to shard: every stage equals DDP, and every offloaded
    # stage equals ZeRO-Offload's single-GPU setup (stage 2 in Ren et al. 2021). Keep one of each.
    plain = [(0, False)] if any(not o for _, o in out) else []
    offloaded = sorted((z for z, o in out if o), key=lambda z: (z != 2, z))[:1]
    return plain + [(z, True) for z in offloaded]


def _variants(pb: Problem, tp: int, pp: int) -> list[tuple[bool, int]]:
    """(sequence parallel, virtual stages) pairs: SP searched when unset and tp > 1; the interleaved
    schedule's v searched over 2..4 when unset (at most the layers per stage; uneven chunks allowed)."""
    tr = pb.train
    sps = [False, True] if tr.sequence_parallel is None and tp > 1 else [bool(tr.sequence_parallel) and tp > 1]
    if pp > 1 and tr.schedule == "interleaved":
        per_stage = pb.model.layers // pp
        vs = [tr.virtual_stages] if tr.virtual_stages else [v for v in (2, 3, 4) if v <= per_stage]
        vs = [v for v in vs if v <= per_stage] or [1]
    else:
        vs = [1]
    return [(sp, v) for sp in sps for v in vs]


def _layout_candidates(pb: Problem, dp: int, tp: int, pp: int, mbs) -> list[Candidate]:
    """Every mode, micro-batch and variant of one layout; recompute resolved to the cheapest that fits.
    Offload (always slower) is evaluated only where the same setting without it does not fit."""
    out = []
    modes = _modes(pb, dp, pp)
    plain_fits: dict = {}
    for zero, offload in sorted(modes, key=lambda zo: zo[1]):
        for b, m in mbs:
            for sp, v in _variants(pb, tp, pp):
                key = (zero, b, sp, v)
                if offload and pb.options.offload == "auto" and plain_fits.get(key, False):
                    continue
                c = evaluate(pb, dp, tp, pp, zero, offload, b, m, sequence_parallel=sp, virtual_stages=v)
                if not offload:
                    plain_fits[key] = c.fits
                out.append(c)
    return out


def enumerate_candidates(pb: Problem) -> tuple[list[Candidate], list[dict]]:
    """Every valid configuration, evaluated; and what was skipped (layouts, or ZeRO modes of a layout),
    each with its reason."""
    world, opts = pb.options.gpus, pb.options
    cands, rejected = [], []
    for tp in divisors(world):
        if opts.tp and tp != opts.tp:
            continue
        why = _tp_problem(pb, tp)
        if why:
            rejected.append({"dp": None, "tp": tp, "pp": None, "reason": why})
            continue
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if (opts.pp and pp != opts.pp) or (opts.dp and dp != opts.dp):
                continue
            why = _pp_problem(pb, pp, dp)
            mbs = [] if why else _micro_batches(pb, dp, pp)
            if not why and not mbs:
                why = _micro_batch_problem(pb, dp, pp)
            if why:
                rejected.append({"dp": dp, "tp": tp, "pp": pp, "reason": why})
                continue
            cands += _layout_candidates(pb, dp, tp, pp, mbs)
    return cands, rejected


TIE = 0.01  # step times within 1% are a tie: well inside what the model can resolve


def rank_key(c: Candidate) -> tuple:
    # Step times within TIE of each other count as a tie (log-spaced buckets); then prefer less traffic, a
    # lower ZeRO stage, no offload, less recomputation, and bigger micro-batches.
    bucket = round(math.log(max(c.step_time_s, 1e-12)) / math.log1p(TIE))
    return (bucket, round(c.comm_bytes_per_step), c.zero_stage, c.offload,
            ("none", "selective", "full").index(c.recompute) if c.recompute in ("none", "selective", "full") else 0,
            -c.micro_batch, c.memory_bytes["total"])
