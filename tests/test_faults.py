"""Faults with real processes: SIGKILL at every step of ``checkpoint.save`` on either rank never leaves
``latest`` naming anything but a complete checkpoint (re-saves of a step included), the survivor ends by
itself, and the next save clears what the killed one left."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_sigkill_at_every_point_of_save_on_either_rank(tmp_path):
    proc = subprocess.run([sys.executable, str(TESTS / "kill_save.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=240, cwd=TESTS, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 2 * (8 + 4)  # both scenarios x (8 points on rank 0 + 4 on rank 1)
    for c in cases:
        where = f"{'re-save' if c['resave'] else 'new step'}, rank {c['rank']} killed at {c['point']!r}"
        status = {int(r): s for r, s in c["status"].items()}
        assert c["hung"] == [], f"{where}: the survivor did not end by itself"
        assert status[c["rank"]] == -9, where
        survivor = status[1 - c["rank"]]
        assert survivor == (0 if c["point"] == "done" else 3), f"{where}: survivor exit {survivor}"
        assert c["after_kill"] == c["expect"], f"{where}: latest holds {c['after_kill']}, want {c['expect']}"
        assert c["tmp_left"] == [], f"{where}: the next save left {c['tmp_left']}"
        step = 1 if c["resave"] else 2
        assert c["after_recovery"] == [step, 4.0], where
        folders = [e for e in c["entries"] if e.startswith("step-")]
        steps = [int(e.split("-")[1].split(".")[0]) for e in folders]
        assert sorted(set(steps)) == sorted(steps), f"{where}: more than one folder for a step: {folders}"
    # The harness did reach the states the cleanup is for.
    assert any(c["tmp_after_kill"] for c in cases)
    assert any(e.startswith("step-00000001.") for c in cases for e in c["entries"])
