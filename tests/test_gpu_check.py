"""benchmarks/gpu_check.sh and gpu_check.py without a GPU: the dry run runs every step's CPU part end to end
and writes the JSON and Markdown report with every CUDA part "not run"; a step that fails or overruns its
budget is recorded as such and the steps after it still run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_report  # noqa: E402


def _driver(out: Path, steps: str | None = None):
    env = dict(os.environ, OUT=str(out))
    if steps is not None:
        env["GPU_CHECK_STEPS"] = steps
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    return _driver(out), out


def test_budgets_fit_eight_minutes():
    assert sum(budget for _, budget in gpu_check.STEPS.values()) <= gpu_check.TOTAL_BUDGET_S <= 480
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--list"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert listed[::2] == list(gpu_check.STEPS)


def test_dry_run_every_step_runs_its_cpu_part(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["dry_run"] is True
    steps = {r["step"]: r for r in data["steps"]}
    assert list(steps) == list(gpu_check.STEPS)
    for name, rec in steps.items():
        assert rec["status"] == "ok", (name, rec.get("error"))
        assert rec["cuda"] == "not run", name
    # What the CPU parts checked, not just that they returned.
    assert all(r["equal"] for r in steps["adam"]["cpu"]["rows"])
    assert steps["offload"]["cpu"]["engine_h2d_GBps"] > 0
    assert steps["zero_offload"]["cpu"]["losses_equal"]
    gelu = steps["gelu"]["cpu"]["rows"]
    assert [r["shape"] for r in gelu] == list(gpu_check.GELU_SHAPES)
    # the fused op saves z alone; eager saves z + b and gelu(z + b): twice the activation bytes
    assert all(r["fused_saved_MiB"] < 0.6 * r["eager_saved_MiB"] for r in gelu)
    rows = steps["wrappers"]["cpu"]["rows"]
    assert set(rows) == set(gpu_check.WRAPPERS) and all(r["equal"] for r in rows.values())
    assert "collected" in steps["tests"]["cpu"]["summary"]


def test_dry_run_markdown_is_a_table_per_step(dry_run):
    _, out = dry_run
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("GPU check (dry run")
    assert "| step | status | s / budget | CUDA part | figures |" in md
    for name in gpu_check.STEPS:
        assert f"\n| {name} | ok |" in md and "not run" in md
    assert "| wrapper | losses | rtol | equal |" in md and "| dtype | params |" in md


def test_a_failing_step_does_not_stop_the_others(tmp_path):
    # The two quickest steps around an unknown one: what is checked is the driver going on after a failure.
    proc = _driver(tmp_path, "env bogus build")
    assert proc.returncode == 1  # the report says something failed
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {r["step"]: r["status"] for r in data["steps"]}
    assert status == {"env": "ok", "bogus": "failed (exit 2, no record)", "build": "ok"}


def test_run_step_records_an_exception_and_a_timeout(tmp_path):
    def boom(dry, budget_s):
        raise RuntimeError("kernel exploded")

    assert gpu_check.run_step("adam", boom, 5, True, tmp_path) == 1
    rec = json.loads((tmp_path / "steps" / "adam.json").read_text())
    assert rec["status"] == "failed" and "kernel exploded" in rec["error"]
    # killed by `timeout` before it could write its record
    assert gpu_check_report.load(tmp_path, "gelu", 124)["status"] == "timeout"
    assert gpu_check_report.load(tmp_path, "adam", 0)["status"] == "failed"
    budgets = {"adam": 5, "gelu": 30}
    assert gpu_check_report.report(tmp_path, {"adam": 1, "gelu": 124}, ["adam", "gelu"], budgets, 35) == 1
    assert "| gelu | timeout |" in (tmp_path / "gpu_check.md").read_text()
