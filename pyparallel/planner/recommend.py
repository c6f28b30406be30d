"""Run the search, pick the fastest configuration that fits, and say why in words.

The sentence follows the usual decision table: a model that fits on one GPU trains fastest with plain
data parallelism; larger model states call for ZeRO-2/3 sharding (Rajbhandari et al. 2020); very deep
models for pipeline stages (Narayanan et al. 2021); matrices too big for one GPU's memory or activations
for tensor parallelism inside a node (Shoeybi et al. 2019); and at scale, combinations of the three.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pyparallel.planner import memory as mem
from pyparallel.planner.errors import PlanError
from pyparallel.planner.search import Candidate, Problem, SearchOptions, enumerate_candidates, rank_key
from pyparallel.planner.specs import CLUSTER_PRESETS, GB, ClusterSpec, ModelSpec, TrainSpec

_SHARDS = {1: "the optimizer state", 2: "the optimizer state and gradients",
           3: "the parameters, gradients and optimizer state"}


@dataclass
class Plan:
    """The search's outcome: every evaluated candidate (fitting ones first, fastest first), the layouts
    turned away, the recommendation, its runner-up and the reason."""

    problem: Problem
    candidates: list[Candidate]
    rejected: list[dict]
    best: Candidate
    runner_up: Candidate | None
    reason: str

    @property
    def runner_up_ratio(self) -> float | None:
        return self.runner_up.step_time_s / self.best.step_time_s if self.runner_up else None

    def to_dict(self) -> dict:
        pb = self.problem
        model = asdict(pb.model) | {"num_params": pb.model.num_params()}
        runner = self.runner_up.to_dict() if self.runner_up else None
        ratio = round(self.runner_up_ratio, 4) if self.runner_up else None
        return {
            "model": model, "training": asdict(pb.train), "cluster": asdict(pb.cluster),
            "gpus": pb.options.gpus, "usable_bytes_per_gpu": int(pb.usable_bytes),
            "candidates": [c.to_dict() for c in self.candidates],
            "skipped": self.rejected,
            "recommendation": {"candidate": self.best.to_dict(), "label": self.best.label(),
                               "reason": self.reason, "runner_up": runner,
                               "runner_up_step_time_ratio": ratio},
        }


def plan(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions) -> Plan:
    """Evaluate every configuration and recommend one; raises :class:`PlanError` when none is valid or
    none fits, with a message that says what to change."""
    pb = Problem(model.validate(), train.validate(), cluster.validate(), options)
    _check_options(options)
    cands, rejected = enumerate_candidates(pb)
    if not cands:
        distinct = list(dict.fromkeys(r["reason"] for r in rejected))
        more = f" (and {len(distinct) - 3} more reasons)" if len(distinct) > 3 else ""
        reasons = "; ".join(distinct[:3]) + more if distinct else "no layout matched --dp/--tp/--pp"
        raise PlanError(f"no valid layout for {options.gpus} GPUs: {reasons}; change --gpus, --global-batch, "
                        f"--micro-batch or the fixed degrees")
    fitting = sorted((c for c in cands if c.fits), key=rank_key)
    if not fitting:
        raise PlanError(no_fit_message(pb, cands))
    rest = sorted((c for c in cands if not c.fits), key=lambda c: c.memory_bytes["total"])
    best = fitting[0]
    runner = next((c for c in fitting if c.strategy != best.strategy), None)
    return Plan(pb, fitting + rest, rejected, best, runner, reason(pb, best, fitting + rest, runner))


def _check_options(opts: SearchOptions) -> None:
    if opts.gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {opts.gpus}")
    for name in ("dp", "tp", "pp"):
        v = getattr(opts, name)
        if v is not None and (v < 1 or opts.gpus % v):
            raise PlanError(f"--{name} {v} does not divide --gpus {opts.gpus}")
    bad = [z for z in opts.zero_stages if z not in (0, 1, 2, 3)]
    if bad or not opts.zero_stages:
        raise PlanError(f"--zero takes stages among 0,1,2,3, got {list(opts.zero_stages)}")


def _zero_name(c: Candidate) -> str:
    name = "DDP" if c.zero_stage == 0 else f"ZeRO-{c.zero_stage}"
    return name + (" + offload" if c.offload else "")


def no_fit_message(pb: Problem, cands: list[Candidate]) -> str:
    small = min(cands, key=lambda c: c.memory_bytes["total"])
    m = small.memory_bytes
    states = m["params"] + m["grads"] + m["optimizer"]
    hints = ["add GPUs (--gpus)"]
    if pb.options.offload == "off" and any(z >= 1 for z in pb.options.zero_stages):
        hints.append("enable offload (--offload auto)")  # offload needs a ZeRO stage
    if pb.train.recompute not in ("full", "auto") and pb.model.has_shape:
        hints.append("recompute activations (--recompute auto, selective or full)")
    if pb.train.sequence_parallel is False and pb.model.has_shape and small.tp > 1:
        hints.append("split activations with --sequence-parallel")
    if m["activations"] > states:
        hints.append("shorten --seq-len" + (" or --micro-batch" if small.micro_batch > 1 else ""))
    bigger = max(CLUSTER_PRESETS.values(), key=lambda c: c.memory_gb)
    if pb.cluster.memory_gb < bigger.memory_gb:
        hints.append(f"pick GPUs with more memory (--cluster {bigger.name})")
    if len(hints) > 1:
        hints[-1] = "or " + hints[-1]
    return (f"does not fit: smallest per-GPU need is {m['total'] / GB:.0f} GB with {_zero_name(small)} on "
            f"{pb.options.gpus} GPUs (DP {small.dp} × TP {small.tp} × PP {small.pp}, micro-batch "
            f"{small.micro_batch}: model states {states / GB:.1f} GB, activations "
            f"{m['activations'] / GB:.1f} GB), but only {pb.usable_bytes / GB:.1f} GB of "
            f"{pb.cluster.memory_gb:g} GB is usable "
            f"({pb.train.margin:.0%} kept free); " + ", ".join(hints))


def _min_need(cands: list[Candidate], pred) -> Candidate | None:
    pool = [c for c in cands if pred(c)]
    return min(pool, key=lambda c: c.memory_bytes["total"]) if pool else None


def _data_parallel_clause(pb: Problem, best: Candidate, cands: list[Candidate]) -> str:
    """Why not data parallelism alone: it does not fit, or it is slower."""
    dp_only = [c for c in cands if c.tp == 1 and c.pp == 1]
    fitting = sorted((c for c in dp_only if c.fits), key=rank_key)
    if fitting:
        alt = fitting[0]
        return (f" It beats the best data-parallel-only choice ({_zero_name(alt)}) by "
                f"{alt.step_time_s / best.step_time_s:.2f}×.")
    small = _min_need(dp_only, lambda c: True)
    if small is None:
        return ""
    return (f" Data parallelism alone cannot fit: even {_zero_name(small)} needs "
            f"{small.memory_bytes['total'] / GB:.1f} GB per GPU, "
            f"{small.memory_bytes['activations'] / GB:.1f} GB of it activations.")


def _zero_clause(pb: Problem, best: Candidate, cands: list[Candidate]) -> str:
    """Why ZeRO (or offload) on a purely data-parallel layout: what DDP would need, what sharding saves."""
    model, tr = pb.model, pb.train
    need = best.memory_bytes["total"] / GB
    states = mem.model_state_bytes(model.num_params(), "ddp", 1, tr.dtype, tr.optimizer)["total"] / GB
    ddp = _min_need(cands, lambda c: c.zero_stage == 0 and c.tp == best.tp and c.pp == best.pp)
    plain = "Plain DDP" if best.dp > 1 else "Training without offload"
    if ddp is not None and ddp.fits:
        head = (f"{plain} also fits ({ddp.memory_bytes['total'] / GB:.1f} GB per GPU), but "
                f"{_zero_name(best)} is faster here")
    else:
        ddp_txt = f"{ddp.memory_bytes['total'] / GB:.1f} GB per GPU, " if ddp else ""
        head = (f"{plain} would need {ddp_txt}{states:.1f} GB of model states alone "
                f"({states * GB / model.num_params():.0f} bytes per parameter), more than the "
                f"{pb.usable_bytes / GB:.1f} GB usable")
    if best.dp > 1:
        head += (f"; ZeRO-{best.zero_stage} shards {_SHARDS[best.zero_stage]} over the {best.dp} "
                 f"data-parallel ranks")
    lower = _min_need(cands, lambda c: 0 < c.zero_stage < best.zero_stage and not c.offload
                      and c.strategy[:3] == best.strategy[:3])
    if lower is not None and not lower.fits:
        head += f" (ZeRO-{lower.zero_stage} would need {lower.memory_bytes['total'] / GB:.1f} GB)"
    if best.offload:
        head += (f"{', and' if best.dp > 1 else ';'} offload (ZeRO-Offload, Ren et al. 2021) keeps the fp32 "
                 f"master weights and optimizer state ({best.cpu_bytes / GB:.1f} GB per rank) in CPU memory "
                 f"for {best.exposed_s['offload']:.2f} s per step of PCIe copies and CPU optimizer work")
    return f"{head}, down to {need:.1f} GB per GPU."


def reason(pb: Problem, best: Candidate, cands: list[Candidate], runner: Candidate | None) -> str:
    """One or two sentences saying why ``best`` wins, then what the runner-up costs."""
    model, world = pb.model, pb.options.gpus
    need, usable = best.memory_bytes["total"] / GB, pb.usable_bytes / GB
    if best.tp == 1 and best.pp == 1 and best.zero_stage == 0:
        text = (f"{model.name} fits on one GPU ({need:.1f} GB of {usable:.1f} GB usable), so plain data "
                f"parallelism over all {world} GPUs is fastest: no sharding traffic, and the gradient "
                f"all-reduce hides behind the backward pass.")
        if world == 1:
            text = f"{model.name} fits on the one GPU ({need:.1f} GB of {usable:.1f} GB usable)."
    elif best.tp == 1 and best.pp == 1:
        text = _zero_clause(pb, best, cands)
    else:
        parts = []
        if best.tp > 1:
            parts.append(f"tensor parallelism of degree {best.tp} inside a node splits every weight matrix "
                         f"(hidden {model.hidden}, FFN {model.ffn_dim}) and most activations {best.tp} ways")
        if best.pp > 1:
            parts.append(f"{best.pp} pipeline stages of about {model.layers / best.pp:.0f} of the "
                         f"{model.layers} layers each hold 1/{best.pp} of the weights, with a "
                         f"{best.bubble_fraction:.0%} bubble at {best.num_microbatches} micro-batches")
        if best.dp > 1:
            zero = f" with ZeRO-{best.zero_stage} sharding {_SHARDS[best.zero_stage]}" \
                if best.zero_stage else ""
            parts.append(f"data parallelism over {best.dp} replicas{zero} supplies the rest")
        if best.offload:
            parts.append(f"offload keeps the fp32 master weights and optimizer state "
                         f"({best.cpu_bytes / GB:.1f} GB per rank) in CPU memory")
        lead = f"At {world} GPUs no single axis suffices: " if best.tp > 1 and best.pp > 1 else ""
        body = "; ".join(parts)
        body = body[0].upper() + body[1:] if not lead else body
        text = f"{lead}{body}, down to {need:.1f} GB per GPU." + _data_parallel_clause(pb, best, cands)
    if runner is not None:
        text += (f" Runner-up: {runner.label()} at {runner.step_time_s:.3g} s per step, "
                 f"{runner.step_time_s / best.step_time_s:.2f}× the recommended step time, with "
                 f"{runner.memory_bytes['total'] / GB:.1f} GB per GPU.")
    return text
