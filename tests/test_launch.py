"""launch() and torchrun run the same user script, on one "node" and on two, with the same results."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun import result, two_nodes

import pyparallel
from pyparallel.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train_ddp.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


_result = result


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
    common = ["--steps", "2", "--batch", "4"]
    outs = two_nodes(lambda rdzv: [sys.executable, "-m", "torch.distributed.run", *rdzv, SCRIPT, *common],
                     ENV, ROOT)
    results = [_result(o) for o in outs if "RESULT " in o]
    assert len(results) == 1 and results[0]["world_size"] == 2
    single = _result(_run([sys.executable, SCRIPT, "--nprocs", "1", *common]))
    assert results[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)
