"""Evaluate one layout, and search every DP × TP × PP layout, ZeRO stage, offload and micro-batch size.

A candidate's memory is that of its fullest pipeline stage; its step time is compute stretched by the
pipeline bubble plus whatever communication cannot hide behind compute (see timing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyparallel.planner import memory as mem
from pyparallel.planner import timing, traffic
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
        return (f"DP {self.dp} × TP {self.tp} × PP {self.pp}, {zero}{off}, "
                f"micro-batch {self.micro_batch} × {self.num_microbatches}")

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
        }


def stage_layers(layers: int, pp: int, stage: int) -> int:
    """Layers on ``stage``; when p does not divide L the last L mod p stages take one more (they hold
    fewer micro-batches of activations under 1F1B than the first)."""
    extra = layers % pp
    return layers // pp + (1 if stage >= pp - extra else 0)


def stage_params(model: ModelSpec, pp: int, stage: int) -> int:
    """Parameters on a pipeline stage: its layers, the embeddings on the first, the final norm and head on
    the last (a tied head is a second copy of the embedding there, as in Megatron-LM)."""
    if not model.has_shape:
        return model.num_params()
    n = stage_layers(model.layers, pp, stage) * model.layer_params()
    if stage == 0:
        n += model.embedding_params()
    if stage == pp - 1:
        n += model.head_params() + (model.vocab * model.hidden if model.tied and pp > 1 else 0)
    return n


def _stage_memory(pb: Problem, dp, tp, pp, zero, offload, mb, m, stage) -> dict:
    model, tr = pb.model, pb.train
    layers = stage_layers(model.layers, pp, stage) if model.has_shape else 0
    params_rank = stage_params(model, pp, stage) / tp
    states = mem.model_state_bytes(params_rank, zero, dp, tr.dtype, tr.optimizer, offload)
    act = mem.stage_activation_bytes(model, tr.seq_len, mb, tp, pp, stage, layers, m, tr.schedule,
                                     tr.virtual_stages, tr.sequence_parallel, tr.recompute, tr.dtype)
    p2p = mb * tr.seq_len * model.hidden * mem.DTYPE_BYTES[tr.dtype] / (tp if tr.sequence_parallel else 1)
    layer_rank = model.layer_params() / tp if model.has_shape else 0.0
    buffers = mem.buffer_bytes(params_rank, layer_rank, zero, dp, tr.dtype, tr.bucket_mb, p2p, pp)
    memory = {"params": states["params"], "grads": states["grads"],
              "optimizer": states["optimizer"] + states["master"], "activations": act["total"],
              "buffers": buffers}
    memory["total"] = sum(memory.values())
    return {"stage": stage, "layers": layers, "params_rank": params_rank, "memory": memory,
            "cpu": states["cpu"], "act": act, "layer_rank": layer_rank}


def evaluate(pb: Problem, dp: int, tp: int, pp: int, zero: int, offload: bool, mb: int, m: int) -> Candidate:
    """Memory, traffic and step time of one configuration."""
    model, tr, cl = pb.model, pb.train, pb.cluster
    world = dp * tp * pp
    stages = {0, pp - 1}
    if model.has_shape and model.layers % pp:
        stages.add(pp - model.layers % pp)  # the first stage given an extra layer
    per_stage = [_stage_memory(pb, dp, tp, pp, zero, offload, mb, m, s) for s in sorted(stages)]
    worst = max(per_stage, key=lambda d: d["memory"]["total"])
    params_rank = max(d["params_rank"] for d in per_stage)
    max_layers = max(d["layers"] for d in per_stage)

    phases = traffic.dp_phases(params_rank, zero, dp, tr.dtype, m, tr.bucket_mb * 2**20, worst["layer_rank"])
    if model.has_shape:
        phases += traffic.tp_phase(max_layers, tr.seq_len, mb, model.hidden, tp, m, tr.dtype, tr.recompute)
        v = tr.virtual_stages if tr.schedule == "interleaved" else 1
        phases += traffic.pp_phase(tr.seq_len, mb, model.hidden, pp, m, tp, tr.sequence_parallel, tr.dtype, v)
    bandwidth = {axis: cl.inter_bw if traffic.spans_nodes(axis, dp, tp, pp, cl.gpus_per_node) else cl.intra_bw
                 for axis in ("dp", "tp", "pp")}

    peak = cl.peak_flops(tr.dtype)
    hw_flops = timing.hardware_flops_per_step(model, tr.seq_len, tr.tokens, tr.recompute)
    imbalance = max_layers * pp / model.layers if model.has_shape else 1.0
    compute_s = hw_flops / (world * peak * tr.efficiency) * imbalance
    bubble = timing.bubble_fraction(pp, m, tr.schedule, tr.virtual_stages)
    per_mb = compute_s / m
    fwd_share = 0.25 if tr.recompute == "full" else 1 / 3  # backward also reruns the forward under full
    windows = {"forward": per_mb * fwd_share, "backward": per_mb * (1 - fwd_share), "none": 0.0}
    exposed = {"dp": 0.0, "tp": 0.0, "pp": 0.0, "offload": 0.0}
    left = dict(windows)  # phases hiding behind the same compute share it (ZeRO-3's backward gather + RS)
    for ph in phases:
        bw = bandwidth[ph.axis]
        e = timing.exposed_seconds(ph, bw, left[ph.overlap])
        exposed[ph.axis] += e
        left[ph.overlap] = max(0.0, left[ph.overlap] - (ph.bytes / (bw * 1e9) - e / ph.repeats))
    off = None
    if offload:
        off = timing.offload_seconds(params_rank / dp, mem.DTYPE_BYTES[tr.dtype], cl.pcie_bw, cl.host_bw,
                                     min(cl.gpus_per_node, world))
        exposed["offload"] = off["total"]
    step = compute_s / (1 - bubble) + sum(exposed.values())
    model_flops = timing.model_flops_per_step(model, tr.seq_len, tr.tokens)
    return Candidate(
        dp=dp, tp=tp, pp=pp, zero_stage=zero, offload=offload, micro_batch=mb, num_microbatches=m,
        memory_bytes=worst["memory"], cpu_bytes=worst["cpu"],
        fits=worst["memory"]["total"] <= pb.usable_bytes,
        comm_bytes=traffic.summarize(phases), exposed_s=exposed, bubble_fraction=bubble, compute_s=compute_s,
        step_time_s=step, mfu=timing.mfu(model_flops, step, world, peak),
        detail={"worst": worst, "phases": phases, "bandwidth": bandwidth, "hw_flops": hw_flops,
                "model_flops": model_flops, "peak": peak, "imbalance": imbalance, "windows": windows,
                "offload": off, "world": world},
    )


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
    if pp > 1 and tr.schedule == "interleaved" and model.layers % (pp * tr.virtual_stages):
        return f"interleaved schedule needs pp × v = {pp * tr.virtual_stages} to divide {model.layers} layers"
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
    """(ZeRO stage, offload) pairs worth evaluating for a layout."""
    out = []
    for z in pb.options.zero_stages:
        if pp > 1 and z >= 2:
            continue  # reported once per layout by enumerate_candidates
        offloads = {"auto": (False, True), "off": (False,), "on": (True,)}[pb.options.offload]
        out += [(z, o) for o in offloads if not (o and z == 0)]
    if dp > 1:
        return out
    # With one data-parallel rank ZeRO has nothing to shard: every stage equals DDP, and every offloaded
    # stage equals ZeRO-Offload's single-GPU setup (stage 2 in Ren et al. 2021). Keep one of each.
    plain = [(0, False)] if any(not o for _, o in out) else []
    offloaded = sorted((z for z, o in out if o), key=lambda z: (z != 2, z))[:1]
    return plain + [(z, True) for z in offloaded]


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
            if pp > 1 and any(z >= 2 for z in opts.zero_stages):
                rejected.append({"dp": dp, "tp": tp, "pp": pp, "reason": "ZeRO-2/3 skipped with pipeline "
                                 "parallelism: they would re-reduce or re-gather for every micro-batch "
                                 "(DeepSpeed rejects the pairing)"})
            for zero, offload in _modes(pb, dp, pp):
                cands += [evaluate(pb, dp, tp, pp, zero, offload, b, m) for b, m in mbs]
    return cands, rejected


def rank_key(c: Candidate) -> tuple:
    # Step times equal to 3 significant digits count as a tie; then prefer less traffic, a lower ZeRO
    # stage, no offload, and bigger micro-batches (real kernels run faster on them; the model's fixed
    # efficiency cannot see it).
    return (float(f"{c.step_time_s:.3g}"), round(c.comm_bytes_per_step), c.zero_stage, c.offload,
            -c.micro_batch, c.memory_bytes["total"])
