"""launch() and torchrun run the same user script, on one "node" and on two, with the same results."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pyparallel
from pyparallel.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_ddp.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _result(stdout: str) -> dict:
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _rank_info(x):
    import torch.distributed as dist

    mesh = pyparallel.init()
    return (dist.get_rank(), mesh.world_size, x * 10)


def _fails_on_rank_1():
    mesh = pyparallel.init()
    if mesh.rank == 1:
        raise KeyError("boom on rank 1")
    return "ok"


def test_launch_returns_each_rank_result():
    assert pyparallel.launch(_rank_info, 2, (4,)) == [(0, 2, 40), (1, 2, 40)]


def test_launch_raises_the_failing_ranks_traceback():
    with pytest.raises(pyparallel.LaunchError) as info:
        pyparallel.launch(_fails_on_rank_1, 2, timeout_s=120)
    assert info.value.rank == 1 and "boom on rank 1" in info.value.remote_traceback


def _run(cmd, timeout=240):
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_torchrun_single_node_matches_launch_and_one_process():
    common = ["--steps", "3", "--batch", "4"]
    launched = _result(_run([sys.executable, SCRIPT, "--nprocs", "2", *common]))
    single = _result(_run([sys.executable, SCRIPT, "--nprocs", "1", *common]))
    torchrun = _result(_run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), SCRIPT, *common]))
    assert torchrun["world_size"] == 2 and launched["world_size"] == 2
    assert torchrun["losses"] == launched["losses"]  # same code path, same numbers
    assert torchrun["losses"] == pytest.approx(single["losses"], rel=1e-5)


def test_torchrun_two_nodes_over_c10d_rendezvous():
    port = free_port()
    common = ["--steps", "2", "--batch", "4"]
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"pp-test-{port}", SCRIPT, *common]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=ENV, cwd=ROOT))
        time.sleep(0.5)
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, out[-2000:] + err[-3000:]
        outs.append(out)
    results = [_result(o) for o in outs if "RESULT " in o]
    assert len(results) == 1 and results[0]["world_size"] == 2
    single = _result(_run([sys.executable, SCRIPT, "--nprocs", "1", *common]))
    assert results[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)
