"""Human-readable output of a plan: a summary, the ranked table (rich if installed, plain text otherwise)
and the JSON file with every evaluated candidate."""

from __future__ import annotations

import json
import sys

from pyparallel.planner.recommend import Plan
from pyparallel.planner.search import Candidate
from pyparallel.planner.specs import GB

HEADERS = ["#", "dp", "tp", "pp", "ZeRO", "mb×m", "recomp", "GB/GPU", "CPU GB", "host GB/node", "comm GB",
           "bubble", "step s", "MFU"]


def summary_lines(plan: Plan) -> list[str]:
    pb = plan.problem
    model, tr, cl, n = pb.model, pb.train, pb.cluster, pb.options.gpus
    if model.has_shape:
        shape = (f"{model.layers} layers, hidden {model.hidden}, {model.heads} heads"
                 + (f" ({model.kv} KV)" if model.kv != model.heads else "")
                 + f", FFN {model.ffn_dim}, vocab {model.vocab}")
    else:
        shape = "parameter count only: model states, no activations, no TP/PP"
    nodes = -(-n // cl.gpus_per_node)
    fit = sum(c.fits for c in plan.candidates)
    sp = {None: "sequence parallelism searched", True: "sequence parallel", False: "no sequence parallelism"}
    return [
        f"Model    {model.name}: {model.num_params():,} parameters ({shape})",
        f"Training seq {tr.seq_len} × global batch {tr.global_batch} = {tr.tokens:,} tokens/step, "
        f"{tr.dtype}, {tr.optimizer}, recompute {tr.recompute}"
        + (" (none/selective/full searched, cheapest that fits)" if tr.recompute == "auto" else "")
        + f", {sp[tr.sequence_parallel]}, schedule {tr.schedule}",
        f"Assumed  {attention_line(model)}" if model.has_shape else
        "Assumed  model states only (no activations without a shape)",
        f"Cluster  {n} × {cl.name} ({nodes} node{'s' if nodes > 1 else ''} of {cl.gpus_per_node}), "
        f"{cl.memory_gb:g} GB per GPU, {pb.usable_bytes / GB:.1f} GB usable ({tr.margin:.0%} margin), "
        f"{cl.peak_flops(tr.dtype) / 1e12:g} TFLOP/s peak, " + compute_line(pb),
        f"Searched {len(plan.candidates)} configurations, {fit} fit"
        + (f"; {len(plan.rejected)} layouts or modes skipped (reasons in --json)" if plan.rejected else ""),
    ]


def attention_line(model) -> str:
    if model.fused_attention:
        return ("fused (flash-style) attention: no s×s scores stored, so activations follow Korthikanti et "
                "al.'s selective-recompute count even without recomputation (--attention unfused to change)")
    return ("unfused attention: the s×s scores, softmax and dropout mask are stored (5·a·s/h per layer) "
            "unless recomputed (--attention fused to change)")


def compute_line(pb) -> str:
    cl, tr = pb.cluster, pb.train
    if tr.efficiency is not None:
        return f"flat {tr.efficiency:.0%} efficiency (--efficiency)"
    if cl.gemm_half_dim <= 0 and cl.hbm_bw <= 0:
        return f"flat {cl.gemm_eff:.0%} efficiency"
    return (f"GEMMs at {cl.gemm_eff:.0%} × k/(k + {cl.gemm_half_dim:g}) of peak, elementwise at "
            f"{cl.hbm_bw:g} GB/s HBM")


def row(rank: int | str, c: Candidate) -> list[str]:
    m = c.memory_bytes
    zero = str(c.zero_stage) + ("+off" if c.offload else "")
    rc = {"none": "none", "selective": "sel", "full": "full"}.get(c.recompute, c.recompute)
    rc += "+SP" if c.sequence_parallel else ""
    return [str(rank), str(c.dp), str(c.tp), str(c.pp), zero, f"{c.micro_batch}×{c.num_microbatches}", rc,
            f"{m['total'] / GB:.1f}", f"{c.cpu_bytes / GB:.1f}" if c.offload else "-",
            f"{c.host_bytes_per_node / GB:.0f}" if c.offload else "-",
            f"{c.comm_bytes_per_step / GB:.2f}", f"{c.bubble_fraction:.1%}", f"{c.step_time_s:.3g}",
            f"{c.mfu:.1%}"]


def table_rows(plan: Plan, top: int) -> list[list[str]]:
    """The best ``top`` distinct strategies (best micro-batch each), fitting ones ranked."""
    rows, seen = [], set()
    for c in plan.candidates:
        if not c.fits or c.strategy in seen:
            continue
        seen.add(c.strategy)
        rows.append(row(len(rows) + 1, c))
        if len(rows) >= top:
            break
    return rows


def _plain_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADERS, *rows]) for i in range(len(HEADERS))]
    fmt = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, widths))
    return "\n".join([fmt(HEADERS), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def render(plan: Plan, top: int = 10, plain: bool = False, file=None) -> None:
    """Print summary, table and recommendation to ``file`` (stdout by default)."""
    out = file or sys.stdout
    rows = table_rows(plan, top)
    console = None
    if not plain:
        try:
            from rich.console import Console  # optional: only for prettier output
            from rich.table import Table
        except ImportError:
            console = None
        else:
            console = Console(file=out, width=None if out.isatty() else 120, highlight=False)
    if console is None:
        print("\n".join(summary_lines(plan)), file=out)
        print(file=out)
        print(_plain_table(rows), file=out)
    else:
        for line in summary_lines(plan):
            console.print(line, markup=False)
        table = Table(title="Fitting configurations, fastest first (best micro-batch each)")
        for i, h in enumerate(HEADERS):
            table.add_column(h, justify="left" if i == 4 else "right")
        for r in rows:
            table.add_row(*r)
        console.print(table)
    best = plan.best
    host = (f", {best.host_bytes_per_node / GB:.0f} GB host RAM per node ({best.cpu_bytes / GB:.1f} GB "
            f"optimizer state per rank)" if best.offload else "")
    print(f"\nRecommended: {best.label()} — {best.step_time_s:.3g} s/step, MFU {best.mfu:.1%}, "
          f"{best.memory_bytes['total'] / GB:.1f} GB per GPU{host}", file=out)
    print(plan.reason, file=out)


def write_json(plan: Plan, path: str) -> None:
    """Write every evaluated candidate (fitting or not) and the recommendation; ``-`` means stdout."""
    text = json.dumps(plan.to_dict(), indent=1)
    if path == "-":
        print(text)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
