"""From per-rank records to one row per strategy: medians, rank maxima, the planner's prediction, the
check against the single-process reference, the flags, and the ratio of each peer (PyTorch, DeepSpeed) to ours.

Conventions (docs/bench.md): step time is the median over timed steps of the slowest rank's time;
memory and traffic are the maximum over ranks (the rank that limits the run), measured and predicted
alike; a step's loss is the mean over data-parallel replicas of the loss over that replica's rows, which
equals the loss of the whole batch in one process.
"""

from __future__ import annotations

import statistics

import torch

from pyparallel.bench.predict import predict_rank, predict_step_time

# Losses equal "within fp32 tolerance": what torch.allclose calls close with these.
RTOL, ATOL = 1e-4, 1e-5
# bf16 rows (``--dtype bf16``) against the same fp32 reference: bf16 weights and activations carry a relative
# rounding error of 2^-8 that compounds over the steps (1-2e-5 on the bench's default 22 steps, more on
# longer runs and larger models; docs/bench.md); 1% says the row trained the same model, not that it is
# bit-equal to the fp32 one.
BF16_RTOL, BF16_ATOL = 1e-2, 1e-3
# A prediction further than this from the measurement flags the row (relative to the measurement).
STATE_TOLERANCE, PEAK_TOLERANCE = 0.10, 0.25


def tolerance(dtype: str) -> tuple[float, float]:
    """(rtol, atol) a row's losses must meet against the fp32 single-process reference."""
    return (BF16_RTOL, BF16_ATOL) if dtype == "bf16" else (RTOL, ATOL)

KEYS = ["strategy", "dp", "tp", "pp", "step_time_s", "tokens_per_s", "model_state_bytes",
        "predicted_model_state_bytes", "peak_bytes", "predicted_peak_bytes", "comm_bytes_per_step",
        "theory_comm_bytes_per_step", "bubble_fraction", "final_loss", "matches_reference"]


def replica_losses(records: list[dict]) -> list[float | None]:
    """Per step, the mean over dp replicas of the loss reported by any rank of that replica."""
    by_replica: dict[int, list] = {}
    for rec in records:
        by_replica.setdefault(rec["coords"]["dp"], [])
        if any(x is not None for x in rec["losses"]):
            by_replica[rec["coords"]["dp"]] = rec["losses"]
    steps = len(records[0]["losses"])
    out = []
    for i in range(steps):
        vals = [ls[i] for ls in by_replica.values() if ls and ls[i] is not None]
        out.append(sum(vals) / len(vals) if len(vals) == len(by_replica) else None)
    return out


def losses_match(losses, reference, dtype: str = "fp32") -> bool:
    if not losses or reference is None or any(x is None for x in losses) or len(losses) != len(reference):
        return False
    rtol, atol = tolerance(dtype)
    return bool(torch.allclose(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(reference, dtype=torch.float64), rtol=rtol, atol=atol))


def _off(measured, predicted, tolerance) -> bool:
    if measured is None or predicted is None or measured == 0:
        return False
    return abs(predicted - measured) / measured > tolerance


def build_row(spec, records, config, reference, on_cpu) -> dict:
    row = {"strategy": spec.name, "dp": spec.dp, "tp": spec.tp, "pp": spec.pp, "peer_of": spec.peer_of}
    if spec.is_peer:
        row["implementation"] = spec.note
    skipped = next((r["skipped"] for r in records if r.get("skipped")), None)
    if skipped:
        row.update({k: None for k in KEYS[4:]}, skipped=skipped, flags=[])
        return row
    cfg = config.gpt()
    times = [max(ts) for ts in zip(*(r["times"] for r in records))]
    step = statistics.median(times) if times else None
    losses = replica_losses(records)
    dtype = "fp32" if spec.name == "single" else config.hp.dtype  # the reference always runs fp32
    preds = [predict_rank(spec, cfg, config.batch, config.seq, config.microbatches, r["coords"]["pp"], on_cpu,
                          dtype) for r in records]
    peaks = [r["peak_bytes"] for r in records]
    bubbles = [r["stats"].get("bubble_fraction") for r in records if r["stats"].get("bubble_fraction") is not None]
    row.update({
        "step_time_s": step,
        "predicted_step_time_s": predict_step_time(spec, cfg, config.batch, config.seq, config.microbatches,
                                                   config.cluster, dtype),
        "tokens_per_s": config.batch * config.seq / step if step else None,
        "model_state_bytes": max(r["states"]["total"] for r in records),
        "predicted_model_state_bytes": max(p["model_state_bytes"] for p in preds),
        "peak_bytes": None if any(p is None for p in peaks) else max(peaks),
        "predicted_peak_bytes": max(p["peak_bytes"] for p in preds),
        "comm_bytes_per_step": _peer_traffic(records) if spec.is_peer else
        max(statistics.median(r["wire_bytes"]) for r in records),
        "theory_comm_bytes_per_step": max(p["comm_bytes_per_step"] for p in preds),
        "bubble_fraction": max(bubbles) if bubbles else None,
        "predicted_bubble_fraction": preds[0]["bubble_fraction"] if spec.pp > 1 else None,
        "final_loss": losses[-1] if losses else None,
        "matches_reference": losses_match(losses, reference, dtype),
        "losses": losses,
        "ranks": [_rank_detail(r, p) for r, p in zip(records, preds)],
    })
    flags = []
    if _off(row["model_state_bytes"], row["predicted_model_state_bytes"], STATE_TOLERANCE):
        flags.append("states")
    if _off(row["peak_bytes"], row["predicted_peak_bytes"], PEAK_TOLERANCE):
        flags.append("peak")
    row["flags"] = flags
    return row


def _peer_traffic(records) -> float | None:
    """A peer's bytes sent per step where it logs its own collectives (DeepSpeed's comms logger, see
    bench/deepspeed_peers.py); None for PyTorch's wrappers, whose collectives pyparallel.comm cannot see."""
    got = [r["stats"].get("comm_bytes_per_step") for r in records]
    return None if any(g is None for g in got) else float(max(got))


def _rank_detail(rec, pred) -> dict:
    return {"rank": rec["rank"], "coords": rec["coords"], "model_state_bytes": rec["states"],
            "peak_bytes": rec["peak_bytes"], "comm_bytes_by_axis": rec["wire_by_axis"],
            "step_times_s": rec["times"], "stats": rec["stats"], "build_s": rec.get("build_s"),
            "wall_s": rec.get("wall_s"), "predicted": pred}


def build_rows(specs, per_rank: list[list[dict]], config, on_cpu: bool) -> list[dict]:
    """``per_rank[r][i]`` is rank r's record of strategy i (the worker's return value per rank)."""
    by_spec = [[per_rank[r][i] for r in range(len(per_rank))] for i in range(len(specs))]
    reference = None
    for spec, recs in zip(specs, by_spec):
        if spec.name == "single" and not recs[0].get("skipped"):
            reference = replica_losses(recs)
    rows = [build_row(spec, recs, config, reference, on_cpu) for spec, recs in zip(specs, by_spec)]
    by_name = {r["strategy"]: r for r in rows}
    for peer in [r for r in rows if r["peer_of"]]:
        mine = by_name.get(peer["peer_of"])
        ratio = None
        if mine and mine.get("step_time_s") and peer.get("step_time_s"):
            ratio = mine["step_time_s"] / peer["step_time_s"]
        peer["ratio"] = ratio
        # Our row carries the ratio to its first peer (PyTorch's, where there is one), and names that peer;
        # every peer row carries its own.
        if mine is not None and mine.get("peer") is None:
            mine.update(ratio=ratio, peer=peer["strategy"])
    return rows
