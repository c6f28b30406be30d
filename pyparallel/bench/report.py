"""The bench's outputs: a table on the terminal, JSON, Markdown and a PNG of step time and memory per
strategy (measured next to predicted). Sizes are MB = 1e6 bytes, as the planner prints them."""

from __future__ import annotations

import json
from pathlib import Path

from pyparallel.bench.results import KEYS, tolerance

_COLUMNS = [
    ("strategy", "strategy"), ("layout", "dp×tp×pp"), ("step_ms", "step ms meas/pred"), ("tokens_per_s", "tok/s"),
    ("states", "states MB meas/pred"), ("peak", "peak MB meas/pred"), ("comm", "comm MB/step meas/theory"),
    ("bubble", "bubble meas/pred"), ("final_loss", "final loss"), ("ref", "= ref"), ("ratio", "ours/peer"),
    ("flags", "flags"),
]


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _pair(a, b, fmt=_mb) -> str:
    return f"{fmt(a)} / {fmt(b)}"


def _cells(row: dict) -> dict:
    layout = f"{row['dp']}×{row['tp']}×{row['pp']}"
    if row.get("skipped"):
        return {"strategy": row["strategy"], "layout": layout, "flags": f"skipped: {row['skipped']}"}
    frac = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    step = row["step_time_s"]
    return {
        "strategy": row["strategy"], "layout": layout,
        "step_ms": _pair(step, row.get("predicted_step_time_s"), lambda x: "-" if x is None else f"{x * 1e3:.1f}"),
        "tokens_per_s": "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.0f}",
        "states": _pair(row["model_state_bytes"], row["predicted_model_state_bytes"]),
        "peak": _pair(row["peak_bytes"], row["predicted_peak_bytes"]),
        "comm": _pair(row["comm_bytes_per_step"], row["theory_comm_bytes_per_step"]),
        "bubble": "-" if row["pp"] == 1 else _pair(row["bubble_fraction"], row.get("predicted_bubble_fraction"),
                                                    frac),
        "final_loss": "-" if row["final_loss"] is None else f"{row['final_loss']:.5f}",
        "ref": "yes" if row["matches_reference"] else "NO",
        "ratio": "-" if row.get("ratio") is None else f"{row['ratio']:.2f}",
        "flags": ", ".join(row["flags"]),
    }


def _grid(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    cells = [_cells(r) for r in rows]
    cols = [(k, h) for k, h in _COLUMNS if k != "ratio" or any(r.get("peer_of") for r in rows)]
    return [h for _, h in cols], [[c.get(k, "") for k, _ in cols] for c in cells]


def table(rows: list[dict]) -> str:
    head, body = _grid(rows)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in body)])


def markdown(rows: list[dict], meta: dict) -> str:
    head, body = _grid(rows)
    dtype = meta.get("dtype", "fp32")
    rtol, atol = tolerance(dtype)
    against = "" if dtype == "fp32" else f" (the {dtype} rows against the fp32 reference)"
    lines = [f"# pyparallel bench: {meta['model']} on {meta['nprocs']} × {meta['device']}, {dtype}", "",
             f"`{meta['command']}`", "",
             f"Global batch {meta['batch']} × {meta['seq']} tokens, {meta['steps']} timed steps after "
             f"{meta['warmup']} warm-up steps, {meta['microbatches']} micro-batches under a pipeline; "
             f"torch {meta['torch']}. Losses match the single-process reference when "
             f"torch.allclose(rtol={rtol:g}, atol={atol:g}) holds at every step{against}. Flags: `states` when the "
             "planner is more than 10% off the measured model-state bytes, `peak` when more than 25% off "
             "the peak. ours/peer: our step time over the peer's (PyTorch's or DeepSpeed's; our row shows its "
             "first peer's).", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def to_json(rows: list[dict], meta: dict) -> dict:
    """Every row carries the documented KEYS (docs/bench.md), then details."""
    out = []
    for r in rows:
        row = {k: r.get(k) for k in KEYS}
        row.update({k: v for k, v in r.items() if k not in row})
        out.append(row)
    rtol, atol = tolerance(meta.get("dtype", "fp32"))
    return {"meta": meta, "tolerance": {"rtol": rtol, "atol": atol}, "rows": out}


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    _ensure_parent(path).write_text(json.dumps(to_json(rows, meta), indent=2))


def write_md(path: str, rows: list[dict], meta: dict) -> None:
    _ensure_parent(path).write_text(markdown(rows, meta))


def write_png(path: str, rows: list[dict], meta: dict) -> None:
    """Two panels: median step time per strategy, and peak / model-state bytes measured vs predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("skipped")]
    names = [r["strategy"] for r in rows]
    x = range(len(rows))
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(rows) + 2), 8), sharex=True)
    xs = list(x)
    ax_t.bar([i - 0.2 for i in xs], [(r["step_time_s"] or 0) * 1e3 for r in rows], 0.4, label="measured",
             color=["#888" if r.get("peer_of") else "#1f77b4" for r in rows])
    ax_t.bar([i + 0.2 for i in xs], [(r.get("predicted_step_time_s") or 0) * 1e3 for r in rows], 0.4,
             label=f"predicted ({meta.get('cluster', 'cpu')} preset)", color="#aec7e8")
    ax_t.set_ylabel("median step time (ms)")
    ax_t.legend(fontsize=8)
    ax_t.set_title(f"pyparallel bench: {meta['model']}, {meta['nprocs']} × {meta['device']} (grey: PyTorch)")
    w = 0.2
    series = [("peak_bytes", "peak measured", "#d62728"), ("predicted_peak_bytes", "peak predicted", "#ff9896"),
              ("model_state_bytes", "states measured", "#2ca02c"),
              ("predicted_model_state_bytes", "states predicted", "#98df8a")]
    for k, (key, label, color) in enumerate(series):
        ax_m.bar([i + (k - 1.5) * w for i in x], [(r[key] or 0) / 1e6 for r in rows], w, label=label, color=color)
    ax_m.set_ylabel("MB per rank (max over ranks)")
    ax_m.legend(fontsize=8)
    ax_m.set_xticks(list(x))
    ax_m.set_xticklabels(names, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(_ensure_parent(path), dpi=100)
    plt.close(fig)


def _ensure_parent(path: str) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p
