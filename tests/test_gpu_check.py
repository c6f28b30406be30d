"""benchmarks/gpu_check.sh, gpu_check.py and gpu_check_report.py without a GPU: the dry run runs every step's
CPU part end to end and leaves the four files that come back from a lent machine (report JSON and Markdown,
one log, one tar.gz of the scratch folder) with every CUDA part "not run"; a step that fails, overruns its
budget or no longer fits in the total is recorded as such and the steps after it still run; the build step
kills its compiler's whole process group on a timeout, and a failed build disables the extension for the
steps after it; the report renders GPU-shaped records."""

import importlib.machinery
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_report  # noqa: E402

OUT_FILES = {"gpu_check.json", "gpu_check.md", "gpu_check.log", "gpu_check_work.tar.gz"}  # of 8 that come back


def _driver(out: Path, work: Path, steps: str | None = None, python: str | None = None):
    # PYTHON: this interpreter (it has torch; `python3` on the PATH may not). One thread per process here.
    env = dict(os.environ, OUT=str(out), GPU_CHECK_WORK=str(work), OMP_NUM_THREADS="1",
               PYTHON=python or sys.executable)
    env.pop("PYPARALLEL_NO_EXT", None)
    if steps is not None:
        env["GPU_CHECK_STEPS"] = steps
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu")
    return _driver(base / "out", base / "work"), base / "out"


def test_budgets_fit_eight_minutes():
    assert sum(budget for _, budget in gpu_check.STEPS.values()) <= 410
    assert gpu_check.TOTAL_BUDGET_S <= 450  # + the last step's 10 s kill grace + the report < 480
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--list"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert [x.split()[0] for x in listed[:-1]] == list(gpu_check.STEPS)
    assert listed[-1] == f"total {gpu_check.TOTAL_BUDGET_S}"


def test_dry_run_every_step_runs_its_cpu_part(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == OUT_FILES
    with tarfile.open(out / "gpu_check_work.tar.gz") as tar:
        members = {m.name.removeprefix("./") for m in tar.getmembers()}
    assert {f"steps/{n}.json" for n in gpu_check.STEPS} | {f"{n}.log" for n in gpu_check.STEPS} <= members
    assert "=== report" in (out / "gpu_check.log").read_text()
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
    assert all(r["max_rel_diff"] <= r["rtol"] for r in rows.values())
    assert "collected" in steps["tests"]["cpu"]["summary"]


def test_dry_run_markdown_is_a_table_per_step(dry_run):
    _, out = dry_run
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("GPU check (dry run")
    assert "torch " in md and "nvcc " in md
    assert "| step | status | s / budget | CUDA part | figures |" in md
    for name in gpu_check.STEPS:
        assert f"\n| {name} | ok |" in md and "not run" in md
    assert "| wrapper | losses | max rel diff | rtol | equal |" in md and "| dtype | params |" in md


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python: gpu_check.py's --list and steps are stubs (each step says whether it ran with the
# extension disabled; build fails); the report is the real one.
if [ "$1 $2" = "benchmarks/gpu_check.py --list" ]; then
  printf 'env 5\\nbuild 5\\nadam 5\\nhuge 1000\\ntotal 100\\n'; exit 0
fi
if [ "$1 $2" = "benchmarks/gpu_check.py --step" ]; then
  echo "$3 ${PYPARALLEL_NO_EXT:-}" >> "$CALLS"
  [ "$3" = build ] && exit 1
  echo '{"step": "'"$3"'", "status": "ok", "budget_s": 5, "cpu": "not run", "cuda": "not run"}' > "$5/steps/$3.json"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def test_driver_goes_on_after_a_failure_skips_what_does_not_fit_and_disables_the_extension(tmp_path, monkeypatch):
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.setenv("REAL_PYTHON", sys.executable)
    proc = _driver(tmp_path / "out", tmp_path / "work", python=str(fake))
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the report says something did not pass
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    status = {r["step"]: r["status"] for r in data["steps"]}
    # "huge" (1000 s) no longer fits in the total: skipped, not started and killed
    assert status == {"env": "ok", "build": "failed (exit 1, no record)", "adam": "ok",
                      "huge": "skipped: no time left"}
    ran = dict((line.split(" ") + [""])[:2] for line in calls.read_text().splitlines())
    built = any(ROOT.joinpath("pyparallel").glob("_C*.so"))
    assert ran == {"env": "" if built else "1", "build": "", "adam": "1"}  # after the failed build: no extension
    assert {p.name for p in (tmp_path / "out").iterdir()} == OUT_FILES


def test_unknown_step_is_an_error():
    assert gpu_check.main(["--step", "bogus", "--dry-run"]) == 2


class _FakeCompile:
    """subprocess.Popen for the build step: records each command; wait() runs past any timeout if ``hang``."""

    def __init__(self, hang: bool):
        self.hang, self.calls = hang, []

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        fake, pid = self, 40000 + len(self.calls)

        class Proc:
            def __init__(self):
                self.pid = pid

            def wait(self, timeout=None):
                if fake.hang and timeout is not None:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                return -9 if fake.hang else 0

        return Proc()


@pytest.mark.parametrize("hang", [False, True], ids=["builds", "times-out"])
def test_build_step_with_a_stubbed_compile(tmp_path, monkeypatch, hang):
    ext_dir = tmp_path / "pkg"
    ext_dir.mkdir()
    monkeypatch.setattr(gpu_check, "EXT_DIR", ext_dir)  # never the checkout's own library
    if not hang:
        (ext_dir / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    popen, killed, probes = _FakeCompile(hang), [], []
    kernels = {"extension": True, "with_cuda": True, "adam_step:CUDA": True, "gelu_linear:CUDA": True}

    def probe(cmd, **kw):
        probes.append(kw["env"])
        return subprocess.CompletedProcess(cmd, 0, json.dumps(kernels) + "\n", "")

    monkeypatch.setattr(gpu_check.subprocess, "Popen", popen)
    monkeypatch.setattr(gpu_check.subprocess, "run", probe)
    monkeypatch.setattr(gpu_check.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setenv("PYPARALLEL_NO_EXT", "1")  # as after an earlier failed build: the build must unset it
    rc = gpu_check.run_step("build", gpu_check.step_build, 60, False, tmp_path)
    rec = json.loads((tmp_path / "steps" / "build.json").read_text())
    cmds = [cmd[1:] for cmd, _ in popen.calls]
    assert cmds[0] == ["setup.py", "build_ext", "--inplace"]  # in place first
    for _, kw in popen.calls:
        assert kw["start_new_session"] is True  # a group of its own, for killpg
        assert kw["env"]["PYPARALLEL_CUDA"] == "1" and "PYPARALLEL_NO_EXT" not in kw["env"]
    if not hang:
        assert rc == 0 and rec["status"] == "ok", rec.get("error")
        assert len(cmds) == 1 and killed == []
        assert len(probes) == 1 and "PYPARALLEL_NO_EXT" not in probes[0]
        assert rec["cuda"]["kernels"]["libraries"]
    else:
        assert rc == 1 and rec["status"] == "failed"
        assert cmds[1][:2] == ["-m", "pip"]  # the fallback
        assert killed == [(40001, signal.SIGKILL), (40002, signal.SIGKILL)]  # the whole group each time
        assert probes == []  # no library: importing the ops would start the compile-on-first-use
        assert "no _C library" in rec["error"]
        assert "timed out" in (tmp_path / "build_compile.log").read_text()


def test_run_step_records_an_exception_a_part_error_and_a_kill(tmp_path):
    def boom(dry, budget_s):
        raise RuntimeError("kernel exploded")

    assert gpu_check.run_step("adam", boom, 5, True, tmp_path) == 1
    rec = json.loads((tmp_path / "steps" / "adam.json").read_text())
    assert rec["status"] == "failed" and "kernel exploded" in rec["error"]

    path, seen = tmp_path / "steps" / "gelu.json", {}

    def cut_short(dry, budget_s):
        gpu_check.save_part("cpu", {"rows": [{"x": 1}]})
        seen.update(json.loads(path.read_text()))  # what a kill at this point would leave
        return {"cpu": {"rows": [{"x": 1}]}, "cuda": {"rows": [], "error": "no CUDA gelu_linear kernels"}}

    assert gpu_check.run_step("gelu", cut_short, 5, False, tmp_path) == 1
    rec = json.loads(path.read_text())
    assert rec["status"] == "failed" and rec["error"] == "cuda: no CUDA gelu_linear kernels"
    assert rec["cpu"] == {"rows": [{"x": 1}]}  # the table survives
    assert seen["status"] == "running" and seen["cpu"] == {"rows": [{"x": 1}]}
    path.write_text(json.dumps(seen))
    killed = gpu_check_report.load(tmp_path, "gelu", 124)
    assert killed["status"] == "timeout" and killed["cpu"] == {"rows": [{"x": 1}]}
    # killed by `timeout` before it could write any record
    assert gpu_check_report.load(tmp_path, "offload", 124)["status"] == "timeout"
    assert gpu_check_report.load(tmp_path, "adam", 0)["status"] == "failed"
    (tmp_path / "steps" / "env.json").write_text(json.dumps({"step": "env", "status": "ok"}))
    assert gpu_check_report.load(tmp_path, "env", 124)["status"] == "timeout"  # done, but killed while exiting
    assert gpu_check_report.load(tmp_path, "env", 1)["status"] == "failed (exit 1)"
    budgets = {"adam": 5, "offload": 30}
    assert gpu_check_report.report(tmp_path, tmp_path, {"adam": 1, "offload": 124}, ["adam", "offload"],
                                   budgets, 35) == 1
    assert "| offload | timeout |" in (tmp_path / "gpu_check.md").read_text()


def _adam_row(dtype, equal):
    return {"dtype": dtype, "numel": 1_000_000_000, "tensors": 128, "max_abs_diff": 1e-6,
            "max_rel_diff": 1e-6 if equal else 0.05, "tolerance": 1e-5, "equal": equal, "checked_steps": 3,
            "ours_ms": 10.0, "torch_fused_ms": 12.0, "ours_GBps": 2800.0, "torch_fused_GBps": 2300.0,
            "ours_over_torch_time": 0.83, "ours_of_copy_bw": 0.9, "torch_of_copy_bw": 0.75}


def _gpu_records() -> dict:
    """Records shaped as the steps write them on a GPU: CUDA parts filled in; adam failed (bf16 differs)."""
    def rec(step, cuda, cpu="not run", status="ok", **extra):
        return {"step": step, "budget_s": gpu_check.STEPS[step][1], "dry_run": False, "status": status,
                "cpu": cpu, "cuda": cuda, "seconds": 3.5, **extra}

    gelu_rows = [{"shape": name, "M,K,N": f"{m},{k},{n}", "dtype": "bfloat16", "approximate": a,
                  "max_err_fused": [0.01] * 4, "max_err_eager": [0.01] * 4, "fused_no_worse": True,
                  "eager_fwd_ms": 1.0, "fused_fwd_ms": 0.8, "eager_fwd_bwd_ms": 3.0, "fused_fwd_bwd_ms": 2.5,
                  "eager_saved_MiB": 200.0, "fused_saved_MiB": 100.0, "fwd_speedup": 1.25, "fwd_bwd_speedup": 1.2}
                 for name, (m, k, n, a) in gpu_check.GELU_SHAPES.items()]
    ref = [7.6, 7.5, 7.4]
    wrappers = {"backend": "nccl", "device": "cuda:0", "model": "bench", "reference": ref,
                "rows": {n: {"losses": ref, "rtol": 2e-2 if "bf16" in n else 1e-4, "equal": True,
                             "max_rel_diff": 2e-6} for n in gpu_check.WRAPPERS}}
    return {
        "env": rec("env", {"device": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.2,
                           "nvidia_smi": "NVIDIA H100 80GB HBM3, 570.86, 81559 MiB, 9.0"},
                   cpu={"python": "3.12.3", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "cuda_available": True,
                        "cpu_count": 16, "nvcc": "Cuda compilation tools, release 13.0, V13.0.88"}),
        "build": rec("build", {"attempts": [{"cmd": "setup.py build_ext --inplace", "rc": 0, "s": 95.0}],
                               "kernels": {"extension": True, "with_cuda": True, "adam_step:CUDA": True,
                                           "gelu_linear:CUDA": True, "libraries": ["_C.so"]}}),
        "tests": rec("tests", {"rc": 0, "summary": "14 passed, 900 deselected in 41.0s", "tail": []}),
        "adam": rec("adam", {"kernel": True, "copy_GBps": 3100.0,
                             "rows": [_adam_row("float32", True), _adam_row("bfloat16", False)],
                             "error": "FusedAdam differs from torch.optim.AdamW(fused=True) in ['bfloat16']"},
                    cpu={"kernel": True, "copy_GBps": 20.0, "rows": [_adam_row("float32", True)]},
                    status="failed",
                    error="cuda: FusedAdam differs from torch.optim.AdamW(fused=True) in ['bfloat16']"),
        "offload": rec("offload", {"bytes": 1 << 30, "pinned": True, "uses_cuda": True, "engine_h2d_GBps": 50.0,
                                   "engine_d2h_GBps": 48.0, "to_h2d_GBps": 45.0, "to_d2h_GBps": 40.0,
                                   "copy_into_pinned_d2h_GBps": 41.0, "pageable_h2d_GBps": 10.0,
                                   "engine_over_to_h2d": 1.1, "engine_over_to_d2h": 1.2}),
        "zero_offload": rec("zero_offload", {"model": "gpt2-small", "batch": 8, "seq": 512, "params": 124_000_000,
                                             "device_step_ms": 80.0, "offload_step_ms": 300.0, "cpu_adam_ms": 250.0,
                                             "copies_ms": 10.0, "serial_estimate_ms": 340.0, "hidden_ms": 40.0,
                                             "losses_equal": True}),
        "gelu": rec("gelu", {"kernel": True, "rows": gelu_rows}),
        "wrappers": rec("wrappers", wrappers, cpu={"reference": ref, "model": "bench", "note": "plain GPT"}),
    }


def test_report_of_gpu_shaped_records(tmp_path):
    records = _gpu_records()
    (tmp_path / "steps").mkdir()
    for name, rec in records.items():
        if name != "gelu":  # skipped: no record
            (tmp_path / "steps" / f"{name}.json").write_text(json.dumps(rec))
    statuses = {n: 0 for n in records} | {"adam": 1, "gelu": "skip"}
    budgets = {n: b for n, (_, b) in gpu_check.STEPS.items()}
    out = tmp_path / "out"
    assert gpu_check_report.report(tmp_path, out, statuses, list(gpu_check.STEPS), budgets, 450) == 1
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("GPU check, `bash benchmarks/gpu_check.sh`:")
    assert "torch 2.11.0+cu130 (CUDA 13.0), nvcc Cuda compilation tools, release 13.0, V13.0.88" in md
    assert "NVIDIA H100 80GB HBM3 (sm 9.0)" in md
    for name in ("env", "build", "tests", "offload", "zero_offload", "wrappers"):
        assert f"\n| {name} | ok |" in md, name
    assert "\n| gelu | skipped: no time left | - / 25 | - | - |" in md
    adam_line = next(x for x in md.splitlines() if x.startswith("| adam |"))
    assert "| failed |" in adam_line and "**cuda: FusedAdam differs" in adam_line and "bfloat16 ours" in adam_line
    assert "| bfloat16 | 1,000,000,000 |" in md and "| 0.05 | NO |" in md  # the mismatch keeps its row
    assert "Adam (cpu, copy bandwidth 20 GB/s)" in md
    assert "| wrapper | losses | max rel diff | rtol | equal |" in md and "| ZeRO-3 bf16 |" in md
    assert "engine H2D 50 / D2H 48 GB/s; .to(non_blocking) H2D 45 / D2H 40 GB/s" in md
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["dry_run"] is False and "H100" in data["versions"]
    assert {r["step"]: r["status"] for r in data["steps"]} == {
        "env": "ok", "build": "ok", "tests": "ok", "adam": "failed", "offload": "ok", "zero_offload": "ok",
        "gelu": "skipped: no time left", "wrappers": "ok"}


def test_report_command_line(tmp_path):
    # As the driver calls it after each step: name:budget[:status]; a step not yet run is "not started".
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "env.json").write_text(json.dumps(_gpu_records()["env"]))
    rc = gpu_check_report.main(["--work", str(tmp_path), "--out", str(tmp_path / "o"), "--total", "450",
                                "env:10:0", "build:180:137", "tests:60"])
    assert rc == 1
    data = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert [r["status"] for r in data["steps"]] == ["ok", "timeout", "not started"]
