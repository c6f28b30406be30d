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
    import torch
    import torch.distributed as dist

    mesh = pyparallel.init()
    gen = torch.Generator().manual_seed(mesh.rank)
    tensors = {"small": torch.randn(3, generator=gen), "big": torch.randn(1 << 20, generator=gen),
               "view": torch.arange(10.0)[2:5], "int": torch.tensor([mesh.rank], dtype=torch.int64)}
    return (dist.get_rank(), mesh.world_size, x * 10, tensors)


def _fails_on_rank_1():
    mesh = pyparallel.init()
    if mesh.rank == 1:
        raise KeyError("boom on rank 1")
    return "ok"


def test_launch_returns_each_rank_result_tensors_included():
    import torch

    out = pyparallel.launch(_rank_info, 2, (4,))
    assert [o[:3] for o in out] == [(0, 2, 40), (1, 2, 40)]
    for rank, (*_, tensors) in enumerate(out):  # copied into the message: alive after the ranks are gone
        gen = torch.Generator().manual_seed(rank)
        assert torch.equal(tensors["small"], torch.randn(3, generator=gen))
        assert torch.equal(tensors["big"], torch.randn(1 << 20, generator=gen))
        assert tensors["view"].tolist() == [2.0, 3.0, 4.0] and tensors["int"].item() == rank


def _dies_on_rank_1(how):
    import signal
    import time

    import torch

    from pyparallel import comm

    mesh = pyparallel.init(timeout_s=60)
    comm.all_reduce(torch.ones(2), mesh.world_group)
    if mesh.rank == 1:
        time.sleep(0.2)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3 if how == "exit3" else 0)
    comm.all_reduce(torch.ones(2), mesh.world_group)  # rank 0 waits for a peer that is gone
    return "unreachable"


@pytest.mark.parametrize("how, code, sig, says", [("exit3", 3, None, "exited with code 3"),
                                                  ("kill", -9, "SIGKILL", "was killed by SIGKILL"),
                                                  ("exit0", 0, None, "exited with code 0")])
def test_launch_names_the_rank_that_died_not_its_survivor(how, code, sig, says):
    with pytest.raises(pyparallel.LaunchError) as info:
        pyparallel.launch(_dies_on_rank_1, 2, (how,), timeout_s=120)
    err = info.value
    assert err.rank == 1 and err.exit_code == code and err.signal == sig, str(err)
    assert str(err).startswith(f"rank 1 failed: rank 1 {says} before returning a result")
    assert any(o.startswith("rank 0 raised CollectiveError") for o in err.others), err.others


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


def _gloo_threads() -> int:
    tasks = Path("/proc/self/task")
    return sum((t / "comm").read_text().startswith(("pt_gloo", "gloo_tcp")) for t in tasks.iterdir())


def _shuts_down():
    import torch
    import torch.distributed as dist

    from pyparallel import comm

    mesh = pyparallel.init(dp=1, tp=2)
    x = torch.full((5,), float(mesh.rank))
    handle = comm.all_reduce(x, mesh.tp_group, async_op=True)  # in flight on a gloo worker thread
    handle.wait()
    values = x.tolist()
    comm.all_gather_object(mesh.rank, mesh.world_group)
    before = _gloo_threads()
    pyparallel.shutdown()
    after = _gloo_threads()
    try:
        comm.all_reduce(x, mesh.tp_group)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    pyparallel.shutdown()  # a second call (or one with no process group) does nothing
    return values, before, after, dist.is_initialized(), error


def test_shutdown_joins_the_gloo_threads_before_the_interpreter_exits():
    # The process groups must really be gone (their worker threads joined) while the interpreter is whole:
    # a gloo thread still releasing a finished collective's tensors at finalization aborts the process.
    for values, before, after, initialized, error in pyparallel.launch(_shuts_down, 2):
        assert values == [1.0] * 5
        assert before > 0 and after == 0, (before, after)
        assert not initialized
        assert "all_reduce on the tp group [0, 1] after pyparallel.shutdown()" in error
