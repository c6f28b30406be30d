"""``pyparallel plan --max-params``: the largest model that fits the cluster, per layout family.

The question of the ZeRO paper's table 2 ("max model size"), asked of the whole planner: for each family
(data parallelism with each ZeRO stage, with offload, tensor parallelism inside a node, TP × PP) the
largest model of the given shape family that has at least one fitting configuration. A model given by
its parameter count grows that count; a model with a shape grows its layer count (width, heads and
vocabulary fixed), which keeps every tensor-parallel split valid. Bisection on the monotone "fits".
"""

from __future__ import annotations

from dataclasses import replace

from pyparallel.planner.errors import PlanError
from pyparallel.planner.recommend import Plan, plan
from pyparallel.planner.search import SearchOptions
from pyparallel.planner.specs import ClusterSpec, ModelSpec, TrainSpec


def families(model: ModelSpec, options: SearchOptions, gpus_per_node: int) -> dict[str, SearchOptions]:
    """Layout families: name -> the search options that restrict to it."""
    base = replace(options, tp=None, pp=None, dp=None)
    out = {}
    for z in (0, 1, 2, 3):
        name = "DDP" if z == 0 else f"ZeRO-{z}"
        out[name] = replace(base, tp=1, pp=1, zero_stages=(z,), offload="off")
    out["ZeRO-3 + offload"] = replace(base, tp=1, pp=1, zero_stages=(3,), offload="on")
    if model.has_shape and options.gpus > 1:
        out["TP (inside a node) × DP, any ZeRO"] = replace(base, pp=1)
        out["TP × PP × DP, any ZeRO"] = base
    return out


def _fits(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, opts: SearchOptions) -> Plan | None:
    try:
        return plan(model, train, cluster, opts)
    except PlanError:
        return None


def _grow(model: ModelSpec, x: int) -> ModelSpec:
    if model.has_shape:
        return replace(model, layers=x, name=f"{model.name} at {x} layers")
    return ModelSpec.from_params(x)


def largest(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, opts: SearchOptions
            ) -> tuple[ModelSpec, Plan] | None:
    """The largest fitting model of ``model``'s family under ``opts``, with its plan (None: none fits)."""
    lo = 1 if model.has_shape else 10**6
    best = _fits(_grow(model, lo), train, cluster, opts)
    if best is None:
        return None
    hi = lo * 2
    while True:
        got = _fits(_grow(model, hi), train, cluster, opts)
        if got is None:
            break
        lo, best, hi = hi, got, hi * 2
        if hi > 10**16:
            break
    step_floor = 1 if model.has_shape else max(1, lo // 1000)  # 0.1% resolution on a count
    while hi - lo > step_floor:
        mid = (lo + hi) // 2
        got = _fits(_grow(model, mid), train, cluster, opts)
        lo, hi, best = (mid, hi, got) if got is not None else (lo, mid, best)
    return _grow(model, lo), best


def max_params_lines(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions
                     ) -> list[str]:
    """One line per family: the largest parameter count that fits and the configuration that fits it."""
    what = "layers (width fixed)" if model.has_shape else "parameters"
    lines = [f"Largest model per layout family on {options.gpus} × {cluster.name} "
             f"({cluster.memory_gb:g} GB, {train.margin:.0%} kept free), growing {what}:"]
    for name, opts in families(model, options, cluster.gpus_per_node).items():
        got = largest(model, train, cluster, opts)
        if got is None:
            lines.append(f"  {name:<34} nothing fits")
            continue
        spec, result = got
        lines.append(f"  {name:<34} {spec.num_params() / 1e9:10.3f} B parameters"
                     + (f" ({spec.layers} layers)" if spec.has_shape else "")
                     + f": {result.best.label()}, {result.best.memory_bytes['total'] / 1e9:.1f} GB per GPU")
    return lines
