"""The GPU check's report (benchmarks/gpu_check.py --report): the steps' records merged into
``gpu_check.json`` and a Markdown summary (``gpu_check.md``: one row per step, then a table per step that has
rows) ready to paste into benchmarks/RESULTS.md. No torch import: it must work whatever the steps did."""

from __future__ import annotations

import json
from pathlib import Path

NOT_RUN = "not run"


def load(out: Path, name: str, rc: int | None, budget_s: float | None = None) -> dict:
    """A step's record; a step killed before writing one (``rc`` 124/137 from ``timeout``) or that never
    started gets a record that says so; a record of success with a non-zero exit status is a failure."""
    path = out / "steps" / f"{name}.json"
    if path.exists():
        rec = json.loads(path.read_text())
        if rc not in (None, 0) and rec.get("status") == "ok":
            rec["status"] = f"failed (exit {rc})"
        return rec
    status = "timeout" if rc in (124, 137) else ("not started" if rc is None else f"failed (exit {rc}, no record)")
    return {"step": name, "status": status, "budget_s": budget_s, "seconds": None}


def _f(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _summary(rec: dict) -> str:
    """One line of key figures per step, from its CUDA part (its CPU part in a dry run)."""
    part = rec.get("cuda")
    where = "cuda"
    if not isinstance(part, dict):
        part, where = rec.get("cpu"), "cpu"
    if not isinstance(part, dict):
        return rec.get("error", "-").splitlines()[0] if rec.get("error") else "-"
    name = rec["step"]
    if name == "adam":
        return f"{where}: copy {_f(part['copy_GBps'])} GB/s; " + "; ".join(
            f"{r['dtype']} ours {_f(r['ours_GBps'])} GB/s ({_f(r['ours_of_copy_bw'], 2)} of copy) vs torch fused "
            f"{_f(r['torch_fused_GBps'])}, equal {_f(r['equal'])}"
            for r in part["rows"]
        )
    if name == "offload":
        s = f"{where}: engine H2D {_f(part['engine_h2d_GBps'])} / D2H {_f(part['engine_d2h_GBps'])} GB/s"
        if "to_h2d_GBps" in part:
            s += f"; .to(non_blocking) H2D {_f(part['to_h2d_GBps'])} / D2H {_f(part['to_d2h_GBps'])} GB/s"
        return s
    if name == "zero_offload":
        return (
            f"{where}: {part['model']} offload {_f(part['offload_step_ms'])} ms vs device {_f(part['device_step_ms'])}"
            f" ms; CPU Adam {_f(part['cpu_adam_ms'])} ms + copies {_f(part['copies_ms'])} ms, hidden "
            f"{_f(part['hidden_ms'])} ms; losses equal {_f(part['losses_equal'])}"
        )
    if name == "gelu":
        return f"{where}: " + "; ".join(
            f"{r['shape']} fwd x{_f(r['fwd_speedup'], 2)}, fwd+bwd x{_f(r['fwd_bwd_speedup'], 2)}, "
            f"saved {_f(r['fused_saved_MiB'])} vs {_f(r['eager_saved_MiB'])} MiB"
            for r in part["rows"]
        )
    if name == "wrappers":
        return f"{where} ({part['backend']}): " + ", ".join(
            f"{n} {'=' if r.get('equal') else '≠'} ref" for n, r in part["rows"].items()
        )
    if name == "tests":
        return f"{where}: {part.get('summary', '')}"
    if name == "build":
        k = part.get("kernels", part)
        return (f"{where}: with_cuda {k.get('with_cuda')}, adam CUDA {k.get('adam_step:CUDA')}, "
                f"gelu CUDA {k.get('gelu_linear:CUDA')}")
    if name == "env":
        return f"{where}: " + ", ".join(
            f"{k} {v}" for k, v in part.items() if k in ("device", "torch", "torch_cuda", "nvcc", "capability")
        )
    return "-"


def _details(records: list[dict]) -> list[str]:
    """Per-step tables for the steps with rows (Adam, gelu_linear, wrappers)."""
    lines = []
    for rec in records:
        for where in ("cuda", "cpu"):
            part = rec.get(where)
            if not isinstance(part, dict):
                continue
            if rec["step"] == "adam":
                lines += [
                    "",
                    f"Adam ({where}, copy bandwidth {_f(part['copy_GBps'])} GB/s):",
                    "",
                    "| dtype | params | ours ms | torch fused ms | ours GB/s | torch GB/s | ours/copy | max rel diff "
                    "| equal |",
                    "|---|---|---|---|---|---|---|---|---|",
                ]
                lines += [
                    f"| {r['dtype']} | {r['numel']:,} | {_f(r['ours_ms'])} | {_f(r['torch_fused_ms'])} | "
                    f"{_f(r['ours_GBps'])} | {_f(r['torch_fused_GBps'])} | {_f(r['ours_of_copy_bw'], 2)} | "
                    f"{_f(r['max_rel_diff'])} | {_f(r['equal'])} |"
                    for r in part["rows"]
                ]
            elif rec["step"] == "gelu":
                lines += [
                    "",
                    f"gelu_linear ({where}):",
                    "",
                    "| shape | dtype | eager fwd ms | fused fwd ms | eager fwd+bwd ms | fused fwd+bwd ms | "
                    "saved MiB eager / fused | no worse |",
                    "|---|---|---|---|---|---|---|---|",
                ]
                lines += [
                    f"| {r['shape']} ({r['M,K,N']}) | {r['dtype']} | {_f(r['eager_fwd_ms'])} | "
                    f"{_f(r['fused_fwd_ms'])} | "
                    f"{_f(r['eager_fwd_bwd_ms'])} | {_f(r['fused_fwd_bwd_ms'])} | {_f(r['eager_saved_MiB'])} / "
                    f"{_f(r['fused_saved_MiB'])} | {_f(r['fused_no_worse'])} |"
                    for r in part["rows"]
                ]
            elif rec["step"] == "wrappers" and "rows" in part:
                lines += [
                    "",
                    f"One GPT step at world size 1 ({where}, {part['backend']}), losses vs the CPU fp32 "
                    f"reference {[round(x, 5) for x in part['reference']]}:",
                    "",
                    "| wrapper | losses | rtol | equal |",
                    "|---|---|---|---|",
                ]
                lines += [
                    f"| {n} | {[round(x, 5) for x in r['losses']] if 'losses' in r else r.get('error')} | "
                    f"{r.get('rtol')} | {_f(r.get('equal'))} |"
                    for n, r in part["rows"].items()
                ]
    return lines


def report(out: Path, rcs: dict[str, int], names: list[str], budgets: dict[str, float], total_budget_s: float) -> int:
    """Merge the steps' records into gpu_check.json and gpu_check.md; 0 when every step passed."""
    records = [load(out, n, rcs.get(n), budgets.get(n)) for n in names]
    dry = any(r.get("dry_run") for r in records)
    env = next((r for r in records if r["step"] == "env"), {})
    payload = {
        "dry_run": dry,
        "total_budget_s": total_budget_s,
        "env": {k: env.get(k) for k in ("cpu", "cuda")},
        "steps": records,
    }
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
    head = "GPU check (dry run: CPU parts only, CUDA parts not run)" if dry else "GPU check"
    lines = [
        f"{head}, `bash benchmarks/gpu_check.sh{' --dry-run' if dry else ''}`:",
        "",
        "| step | status | s / budget | CUDA part | figures |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        cuda = r.get("cuda")
        cuda_s = NOT_RUN if cuda == NOT_RUN else ("-" if cuda is None else "ran")
        lines.append(
            f"| {r['step']} | {r['status']} | {_f(r.get('seconds'))} / {_f(r.get('budget_s'))} | {cuda_s} | "
            f"{_summary(r)} |"
        )
    lines += _details(records)
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["status"] == "ok" for r in records) else 1
