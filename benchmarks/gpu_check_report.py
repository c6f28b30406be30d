"""The GPU check's report: the steps' records (in the scratch folder) merged into ``$OUT/gpu_check.json`` and a
Markdown summary (``$OUT/gpu_check.md``: one row per step, then a table per step that has rows) ready to paste
into benchmarks/RESULTS.md. No torch import: it must work whatever the steps did, and it runs after every
step (benchmarks/gpu_check.sh), so a run killed later still leaves a current report.

    python benchmarks/gpu_check_report.py --work DIR --out DIR --total 450 env:10:0 build:180:1 adam:35:skip gelu:25

Each step is ``name:budget[:status]``, status the step's exit code, ``skip`` (the driver had no time left for
it), or nothing (not started yet).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NOT_RUN = "not run"
SKIPPED = "skip"


def load(work: Path, name: str, rc: int | str | None, budget_s: float | None = None) -> dict:
    """A step's record; a step killed before writing one (``rc`` 124/137 from ``timeout``), skipped, or not
    started gets a record that says so; a record of success with a non-zero exit status is a failure, and
    one still "running" was killed with the parts it had finished."""
    if rc == SKIPPED:
        return {"step": name, "status": "skipped: no time left", "budget_s": budget_s, "seconds": None}
    path = work / "steps" / f"{name}.json"
    rec = None
    if path.exists():
        try:
            rec = json.loads(path.read_text())
        except ValueError:  # killed while writing it
            rec = None
    killed = rc in (124, 137)
    if rec is not None:
        if rec.get("status") == "running":
            rec["status"] = "running" if rc is None else ("timeout" if killed else f"failed (exit {rc})")
        elif rc not in (None, 0) and rec.get("status") == "ok":  # e.g. killed while exiting, past its budget
            rec["status"] = "timeout" if killed else f"failed (exit {rc})"
        return rec
    status = "timeout" if killed else ("not started" if rc is None else f"failed (exit {rc}, no record)")
    return {"step": name, "status": status, "budget_s": budget_s, "seconds": None}


def _f(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _cell(text: str) -> str:
    # An error message inside a Markdown table cell: one line, no column breaks.
    return " ".join(str(text).split()).replace("|", "\\|")


def _figures(rec: dict) -> str:
    """One line of key figures per step, from its CUDA part (its CPU part in a dry run)."""
    part = rec.get("cuda")
    where = "cuda"
    if not isinstance(part, dict):
        part, where = rec.get("cpu"), "cpu"
    if not isinstance(part, dict):
        return "-"
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


def _summary(rec: dict) -> str:
    """The figures, then the first line of the error of a step that did not pass."""
    try:
        figures = _figures(rec)
    except (KeyError, TypeError, IndexError, AttributeError):  # a part cut short: the error says why
        figures = "-"
    error = rec.get("error")
    if error and rec.get("status") != "ok":
        first = f"**{_cell(error.splitlines()[0])[:300]}**"
        return first if figures == "-" else f"{_cell(figures)}; {first}"
    return _cell(figures)


def _details(records: list[dict]) -> list[str]:
    """Per-step tables for the steps with rows (Adam, gelu_linear, wrappers)."""
    lines = []
    for rec in records:
        for where in ("cuda", "cpu"):
            part = rec.get(where)
            if not isinstance(part, dict) or not part.get("rows"):
                continue
            if rec["step"] == "adam":
                lines += [
                    "",
                    f"Adam ({where}, copy bandwidth {_f(part.get('copy_GBps'))} GB/s):",
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
            elif rec["step"] == "wrappers":
                lines += [
                    "",
                    f"One GPT step at world size 1 ({where}, {part.get('backend')}), losses vs the CPU fp32 "
                    f"reference {[round(x, 5) for x in part.get('reference', [])]}:",
                    "",
                    "| wrapper | losses | max rel diff | rtol | equal |",
                    "|---|---|---|---|---|",
                ]
                lines += [
                    f"| {n} | {[round(x, 5) for x in r['losses']] if 'losses' in r else _cell(r.get('error'))} | "
                    f"{_f(r.get('max_rel_diff'))} | {r.get('rtol')} | {_f(r.get('equal'))} |"
                    for n, r in part["rows"].items()
                ]
    return lines


def _versions(env: dict) -> str:
    """torch, its CUDA, nvcc and the device, from the env step (question marks where it did not run)."""
    cpu = env.get("cpu") if isinstance(env.get("cpu"), dict) else {}
    cuda = env.get("cuda") if isinstance(env.get("cuda"), dict) else {}
    device = f"{cuda['device']} (sm {cuda.get('capability')})" if "device" in cuda else "no GPU"
    return (f"torch {cpu.get('torch', '?')} (CUDA {cpu.get('torch_cuda', '?')}), nvcc {cpu.get('nvcc') or '?'}, "
            f"python {cpu.get('python', '?')}, {device}")


def report(work: Path, out: Path, statuses: dict, names: list[str], budgets: dict[str, float],
           total_budget_s: float, echo: bool = False) -> int:
    """Merge the steps' records into out/gpu_check.json and out/gpu_check.md; 0 when every step passed."""
    records = [load(work, n, statuses.get(n), budgets.get(n)) for n in names]
    dry = any(r.get("dry_run") for r in records)
    env = next((r for r in records if r["step"] == "env"), {})
    payload = {
        "dry_run": dry,
        "total_budget_s": total_budget_s,
        "versions": _versions(env),
        "env": {k: env.get(k) for k in ("cpu", "cuda")},
        "steps": records,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(payload, indent=2, default=str))
    head = "GPU check (dry run: CPU parts only, CUDA parts not run)" if dry else "GPU check"
    lines = [
        f"{head}, `bash benchmarks/gpu_check.sh{' --dry-run' if dry else ''}`:",
        "",
        _versions(env) + ".",
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
    if echo:
        print("\n".join(lines))
    return 0 if all(r["status"] == "ok" for r in records) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="the scratch folder with steps/<name>.json")
    ap.add_argument("--out", required=True, help="where gpu_check.json and gpu_check.md go")
    ap.add_argument("--total", type=float, default=None, help="the run's time budget in seconds")
    ap.add_argument("--print", action="store_true", help="print the Markdown too")
    ap.add_argument("steps", nargs="*", metavar="NAME:BUDGET[:STATUS]")
    a = ap.parse_args(argv)
    names, budgets, statuses = [], {}, {}
    for spec in a.steps:
        name, budget, *status = spec.split(":")
        names.append(name)
        budgets[name] = float(budget)
        if status and status[0] != "":
            statuses[name] = status[0] if status[0] == SKIPPED else int(status[0])
    return report(Path(a.work), Path(a.out), statuses, names, budgets, a.total, echo=a.print)


if __name__ == "__main__":
    sys.exit(main())
