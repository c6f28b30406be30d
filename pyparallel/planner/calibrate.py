"""``pyparallel plan --calibrate bench.json``: fit the compute model and the link bandwidth to measurements.

A ``pyparallel bench --json`` file holds, per strategy, the measured median step time of one layout of the
bench GPT on this machine. Two things are fitted, in this order, each by bisection so that the planner's
own step-time model (steptime.py, the same code that ranks layouts) reproduces the measurement:

1. ``gemm_eff``, the GEMM efficiency ceiling, on the ``single`` row (one process, the whole batch: compute
   only, no communication). The curve's shape (half-performance size, HBM bandwidth) is kept from the
   preset: one row of one model cannot separate it from the ceiling.
2. ``intra_bw`` (and ``inter_bw`` scaled by the same factor), on the rows with data or tensor
   parallelism (our strategies, not the PyTorch peers): the bandwidth at which the predicted step time of
   each row equals its measurement; the median over rows is kept.

The result is a cluster (``ClusterSpec`` overrides) that ``--save-cluster FILE`` writes as JSON, which
``--cluster FILE`` (plan and bench alike) reads back: the bench's predicted columns then use it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace

from pyparallel.planner.errors import PlanError
from pyparallel.planner.search import Problem, SearchOptions, evaluate
from pyparallel.planner.specs import ClusterSpec, ModelSpec, TrainSpec, resolve_cluster


@dataclass(frozen=True)
class Row:
    """What calibration needs of one bench row."""

    name: str
    dp: int
    tp: int
    pp: int
    zero: int
    offload: bool
    schedule: str
    virtual: int
    step_time_s: float


@dataclass
class Calibration:
    cluster: ClusterSpec
    overrides: dict
    rows: list[dict] = field(default_factory=list)  # per row: measured, predicted before and after
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        fitted = ", ".join(f"{k} {v:.4g}" for k, v in self.overrides.items())
        out = [f"Calibrated {self.cluster.name}: {fitted or 'nothing could be fitted'}"]
        for r in self.rows:
            out.append(f"  {r['strategy']:<16} measured {r['measured_s'] * 1e3:8.1f} ms, predicted "
                       f"{r['before_s'] * 1e3:8.1f} ms before, {r['after_s'] * 1e3:8.1f} ms after")
        return out + [f"  note: {n}" for n in self.notes]


def predict(model: ModelSpec, cluster: ClusterSpec, row: Row, batch: int, seq: int, microbatches: int,
            dtype: str = "fp32") -> float:
    """The planner's step time for a bench row (as pyparallel.bench.predict asks it, on ``cluster``)."""
    m = microbatches if row.pp > 1 else 1
    v = row.virtual if row.schedule == "interleaved" else 1
    train = TrainSpec(seq_len=seq, global_batch=batch, micro_batch=batch // row.dp // m, dtype=dtype,
                      optimizer="adamw", recompute="selective", schedule=row.schedule, virtual_stages=v)
    pb = Problem(model, train, cluster, SearchOptions(gpus=row.dp * row.tp * row.pp))
    return evaluate(pb, row.dp, row.tp, row.pp, row.zero, row.offload, train.micro_batch, m).step_time_s


def _bisect(f, lo: float, hi: float, steps: int = 60) -> float | None:
    """x in [lo, hi] (log-spaced search) with f(x) = 0 for f decreasing in x; None when there is none."""
    if f(lo) < 0 or f(hi) > 0:
        return None
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    return (lo * hi) ** 0.5


def fit(model: ModelSpec, base: ClusterSpec, rows: list[Row], batch: int, seq: int, microbatches: int,
        dtype: str = "fp32") -> Calibration:
    """Fit ``gemm_eff`` on the single-process row, then the bandwidths on the parallel rows."""
    cal = Calibration(cluster=base, overrides={})
    before = {r.name: predict(model, base, r, batch, seq, microbatches, dtype) for r in rows}
    single = next((r for r in rows if r.dp * r.tp * r.pp == 1), None)
    cluster = base
    if single is None:
        cal.notes.append("no single-process row: compute efficiency kept from the preset")
    else:
        eff = _bisect(lambda e: predict(model, replace(cluster, gemm_eff=e), single, batch, seq, microbatches,
                                        dtype) - single.step_time_s, 1e-4, 1.0)
        if eff is None:
            cal.notes.append(f"single row {single.step_time_s:.4g} s is faster than the model allows at 100% "
                             f"of peak: raise the preset's peak (--peak-tflops)")
        else:
            cluster = replace(cluster, gemm_eff=eff)
            cal.overrides["gemm_eff"] = eff
    scales = []
    for r in rows:
        if (r.dp > 1 or r.tp > 1) and r.pp == 1:
            def gap(x, r=r):
                c = replace(cluster, intra_bw=base.intra_bw * x, inter_bw=base.inter_bw * x)
                return predict(model, c, r, batch, seq, microbatches, dtype) - r.step_time_s
            x = _bisect(gap, 1e-4, 1e4)
            if x is not None:
                scales.append(x)
    if scales:
        x = statistics.median(scales)
        cluster = replace(cluster, intra_bw=base.intra_bw * x, inter_bw=base.inter_bw * x)
        cal.overrides |= {"intra_bw": cluster.intra_bw, "inter_bw": cluster.inter_bw}
    else:
        cal.notes.append("no data- or tensor-parallel row the model could match: bandwidths kept")
    cal.cluster = cluster.validate()
    for r in rows:
        cal.rows.append({"strategy": r.name, "measured_s": r.step_time_s, "before_s": before[r.name],
                         "after_s": predict(model, cluster, r, batch, seq, microbatches, dtype)})
    return cal


def _rows(data: dict, path: str) -> list[Row]:
    from pyparallel.bench import specs as bench_specs

    meta = data["meta"]
    known = bench_specs.known(int(meta["nprocs"])) | bench_specs.named(1)
    rows = []
    for r in data["rows"]:
        spec = known.get(r.get("strategy"))
        if spec is None or spec.is_peer or not r.get("step_time_s"):
            continue
        rows.append(Row(spec.name, spec.dp, spec.tp, spec.pp, spec.zero, spec.offload, spec.schedule,
                        spec.virtual, float(r["step_time_s"])))
    if not rows:
        raise PlanError(f"calibration file {path} has no measured rows of pyparallel's own strategies")
    return rows


def calibrate_file(path: str, cluster_name: str | None = None) -> Calibration:
    """Read a ``pyparallel bench --json`` file and fit the cluster it ran on (its meta's preset unless
    ``cluster_name`` is given). Rebuilding the bench model's shape imports torch."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise PlanError(f"cannot read calibration file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"calibration file {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or "meta" not in data or "rows" not in data:
        raise PlanError(f"calibration file {path} is not a `pyparallel bench --json` file (no meta/rows)")
    meta = data["meta"]
    from pyparallel.bench.predict import model_spec
    from pyparallel.models.gpt import gpt_config

    model = model_spec(gpt_config(meta["model"], **meta.get("overrides", {})))
    base = resolve_cluster(cluster_name or meta.get("cluster") or "cpu")
    return fit(model, base, _rows(data, path), int(meta["batch"]), int(meta["seq"]), int(meta["microbatches"]))


def save_cluster(cluster: ClusterSpec, path: str) -> None:
    """Write a cluster as JSON for ``--cluster FILE``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(asdict(cluster), f, indent=1)
        f.write("\n")
