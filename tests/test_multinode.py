"""Two hosts for real: each torchrun "node" in its own network namespace with its own address, hostname and
interface (tests/netns.py), rendezvous over c10d on node 0's address, gloo on the veth link. Parity with
the same four ranks on one host (DDP, ZeRO-3, dp x tp; ``pyparallel train`` with a shared checkpoint
folder), node-local checkpoint folders (refused by the default storage; with ``--checkpoint-storage
node-local`` each node's own disk resumes exactly, and a load needing the other node's pieces fails on every
rank), a node lost mid-run (its link cut, its processes killed: the survivors end by themselves with a
named error within the collective timeout), and an elastic restart that resumes exactly. Skipped, with the
reason, only where namespaces cannot be created (no root, no iproute2)."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from netns import TwoHosts, unavailable
from torchrun import result as _result

from pyparallel.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "multinode_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TRAIN = [sys.executable, "-m", "pyparallel.cli", "train", "--batch", "8", "--seq", "16", "--lr", "3e-3",
         "--no-progress"]

_why = unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"two-host tests: {_why}")


@pytest.fixture
def hosts():
    h = TwoHosts()
    try:
        yield h
    finally:
        h.close()


def _torchrun(hosts, node, port, argv, nnodes="2", extra=(), local=(), disks=None, conf=""):
    """torchrun on ``node``: 2 local ranks, c10d rendezvous hosted by node 0 at its own address; ``conf``:
    more ``--rdzv-conf`` settings (",key=value...")."""
    return hosts.command(node, local=local, disks=disks, argv=[
        sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr[0]}:{port}", "--rdzv-id", f"pp-{port}",
        # The endpoint is an address, not the node's hostname: tell torchrun which node serves it, and
        # which address this node is reached at (its hostname resolves to nothing on this test network).
        "--rdzv-conf", f"is_host={int(node == 0)}{conf}", "--local-addr", hosts.addr[node], *extra, *argv])


class _Node(subprocess.Popen):
    """A node's torchrun writing its stdout and stderr into files, not pipes. Its output is read once it
    has ended (``communicate``), so it never waits for a reader: a pipe the test is not reading (the other
    node's, while it waits on this one, or both while it polls the metrics) fills at 64 KiB and stops the
    writer mid-run -- and a node that cannot finish keeps the other node's agent in torchrun's exit
    barrier for its 300 s."""

    def __init__(self, cmd, env):
        self._files = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
        super().__init__(cmd, stdout=self._files[0], stderr=self._files[1], text=True, env=env, cwd=ROOT)

    def communicate(self, input=None, timeout=None):  # Popen's signature
        self.wait(timeout=timeout)
        out = []
        for f in self._files:
            f.seek(0)
            out.append(f.read())
        return tuple(out)


def _start(hosts, node, port, argv, env=None, **kw):
    return _Node(_torchrun(hosts, node, port, argv, **kw), env or hosts.env(node, ENV))


def _both(hosts, argv, timeout=300):
    port = free_port()
    procs = [_start(hosts, node, port, argv) for node in (0, 1)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, out[-2000:] + err[-4000:]
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
    return outs


_ONE_HOST: dict[tuple, str] = {}


def _one_host(argv, timeout=300):
    """The same four ranks on one host: the reference runs. Each distinct command runs once per session
    (the restart tests compare against the same uninterrupted run)."""
    key = tuple(argv)
    if key not in _ONE_HOST:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        _ONE_HOST[key] = done.stdout
    return _ONE_HOST[key]


def test_ddp_zero3_and_dp_x_tp_across_two_hosts_equal_one_host(hosts):
    strategies = "ddp,zero3,dp2xtp2"
    outs = _both(hosts, [WORKER, strategies])
    across = _result(next(o for o in outs if "RESULT " in o))
    local = _result(_one_host([WORKER, strategies]))
    assert across["hosts"] == ["node0", "node0", "node1", "node1"]  # really two hosts, ranks by node
    for name in strategies.split(","):
        assert len(across["losses"][name]) == 3
        # Same ranks, same collectives in the same order: the same numbers, whatever the wire.
        assert across["losses"][name] == local["losses"][name], name


def _train(*args):
    """``pyparallel train`` as torchrun runs it (``-m``: the package's CLI module), 3 steps of the tiny GPT."""
    return ["-m", "pyparallel.cli", "train", *TRAIN[4:], *args]


def test_pyparallel_train_across_two_hosts_with_a_shared_checkpoint_folder(hosts, tmp_path):
    shared = str(tmp_path / "ckpt")  # one folder both nodes see: the normal cluster case
    # dp 2 x tp 2 with ZeRO-1: the optimizer state is sharded across the hosts, so both nodes write pieces.
    train = ("--tp", "2", "--zero", "1")
    across = _result(next(o for o in _both(hosts, _train(*train, "--steps", "4", "--checkpoint-dir", shared))
                          if "RESULT " in o))
    whole = _result(_one_host(_train(*train, "--steps", "6")))
    assert across["world_size"] == 4 and across["layout"] == {"dp": 2, "tp": 2, "pp": 1, "zero": 1}
    assert across["losses"] == whole["losses"][:4]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000004"
    # Resumed across the hosts from the shared folder: the uninterrupted run's next steps.
    more = _both(hosts, _train(*train, "--steps", "6", "--checkpoint-dir", shared, "--resume"))
    resumed = _result(next(o for o in more if "RESULT " in o))
    assert resumed["start"] == 4 and resumed["losses"] == whole["losses"][4:]


def _wait_for_steps(metrics: Path, n: int, procs, timeout=180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{metrics} did not reach {n} steps in {timeout} s")


def test_a_lost_node_ends_the_survivors_with_a_named_error_within_the_timeout(hosts, tmp_path):
    metrics, limit = tmp_path / "metrics.jsonl", 20
    port = free_port()
    argv = _train("--steps", "100000", "--metrics", str(metrics))
    env = {"PYPARALLEL_TIMEOUT": str(limit)}
    procs = [_start(hosts, node, port, argv, env={**hosts.env(node, ENV), **env}) for node in (0, 1)]
    try:
        _wait_for_steps(metrics, 3, procs)
        hosts.cut(1)  # the partition first: node 1's sockets cannot even say goodbye
        hosts.kill(1)
        lost = time.monotonic()
        out, err = procs[0].communicate(timeout=limit + 60)
        took = time.monotonic() - lost
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode != 0
    assert took <= limit + 30, took  # the collective timeout plus torchrun's shutdown, never a hang
    # Each survivor names the collective it waited in, its group and the ranks of that group: the step's
    # gradient reduction on 'dp', or its overflow / gradient-norm check on 'world' (zero/engine.py) if the
    # node went while a rank was in that (both groups hold the four ranks here).
    named = [ln for ln in err.splitlines() if "pyparallel.comm.Collective" in ln]
    assert named, err[-3000:]
    for line in named:
        assert any(f"on group '{g}' (global ranks [0, 1, 2, 3])" in line for g in ("dp", "world")), line
        # Node 1's ranks, by global rank and host: dead pids where this machine can see them (the test's
        # hosts share a kernel), else the host that holds them.
        dead = all(f"global rank {r} (pid " in line for r in (2, 3)) and "on node1) is no longer running" in line
        assert dead or "peers on node1 (global ranks 2, 3) may have" in line, line


def _losses_by_step(path: Path) -> dict[int, float]:
    """step -> loss, the last record of each step (a restarted run logs the steps after its checkpoint twice)."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def test_a_job_restarted_after_a_node_is_lost_resumes_exactly(hosts, tmp_path):
    # What a scheduler does when a node dies (SLURM --requeue, a Kubernetes Job's restart): start torchrun
    # again on every node with --resume. (torchrun's own elastic rejoin: the next test.)
    # 40 steps, the node lost after step 5: the job must still be running when the kill lands (with 10, one
    # CI run found that the first round had saved its last step before node 1 was gone).
    shared, metrics, steps = str(tmp_path / "ckpt"), tmp_path / "metrics.jsonl", 40
    argv = _train("--steps", str(steps), "--save-every", "2", "--checkpoint-dir", shared, "--resume",
                  "--metrics", str(metrics))
    env = [{**hosts.env(node, ENV), "PYPARALLEL_TIMEOUT": "30"} for node in (0, 1)]

    def start(port, node):
        return _start(hosts, node, port, argv, env=env[node])

    port = free_port()
    first = [start(port, 0), start(port, 1)]
    try:
        _wait_for_steps(metrics, 5, first)
        hosts.kill(1)  # node 1 is gone: node 0's ranks fail, its torchrun ends
        first[0].communicate(timeout=90)
    finally:
        for p in first:
            p.kill()
    assert first[0].returncode != 0
    saved = (Path(shared) / "latest").read_text().strip()
    outs = _both(hosts, argv)  # the job again, on both nodes
    result = _result(next(o for o in outs if "RESULT " in o))
    assert result["world_size"] == 4 and result["start"] == int(saved.split("-")[1]) >= 4
    whole = _result(_one_host(_train("--steps", str(steps))))
    got = _losses_by_step(metrics)
    assert [got[s] for s in range(steps)] == whole["losses"]  # every step, the rerun ones too, bit for bit


def test_an_elastic_job_resumes_exactly_when_the_lost_node_rejoins(hosts, tmp_path):
    # torchrun --nnodes 1:2 --max-restarts 3 on both nodes. Node 1 is killed after step 5; node 0's agent
    # stays up, restarts its workers and waits in a new rendezvous round; node 1 comes back (a new agent
    # joins that round) and the job goes on from the last checkpoint with all four ranks. Without the
    # agents' shared store (docs/multinode.md): with it, a rejoining agent waits forever for the round's
    # MASTER_ADDR, which the surviving rank-0 agent does not publish again (pytorch/pytorch#147064).
    # 40 steps, the node lost after step 5: the job must still be running when the kill lands (with 10, one
    # CI run found that the first round had saved its last step before node 1 was gone).
    shared, metrics, steps = str(tmp_path / "ckpt"), tmp_path / "metrics.jsonl", 40
    argv = _train("--steps", str(steps), "--save-every", "2", "--checkpoint-dir", shared, "--resume",
                  "--metrics", str(metrics))
    env = [{**hosts.env(node, ENV), "PYPARALLEL_TIMEOUT": "30", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
           for node in (0, 1)]
    port = free_port()

    def start(node):  # last_call_timeout: the round waits this long for node 1 before going on without it
        cmd = _torchrun(hosts, node, port, argv, nnodes="1:2", extra=("--max-restarts", "3"),
                        conf=",last_call_timeout=60")
        return _Node(cmd, env[node])

    procs = [start(0), start(1)]
    try:
        _wait_for_steps(metrics, 5, procs)
        hosts.kill(1)
        procs[1].communicate(timeout=60)
        assert procs[0].poll() is None  # node 0's agent did not give up
        procs[1] = start(1)  # the node is back
        done = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], done[0][1][-3000:] + done[1][1][-3000:]
    err0 = done[0][1]
    # Node 0's workers failed on the lost peers, and the same torchrun ended well: its agent restarted them.
    assert "pyparallel.comm.CollectiveError" in err0, err0[-3000:]
    result = _result(next(out for out, _ in done if "RESULT " in out))
    saved = sorted(os.listdir(shared))
    assert result["world_size"] == 4 and 4 <= result["start"] < steps, (result, saved)
    whole = _result(_one_host(_train("--steps", str(steps))))
    got = _losses_by_step(metrics)
    assert [got[s] for s in range(steps)] == whole["losses"]  # the rerun steps too, bit for bit


def _run_both(hosts, argv, local):
    """Both nodes, node 1 with ``local`` folders of its own; (return codes, stderrs)."""
    port = free_port()
    procs = [_start(hosts, node, port, argv, local=local if node else ()) for node in (0, 1)]
    try:
        errs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], errs


def test_node_local_checkpoint_folders_are_refused_not_half_saved_or_half_resumed(hosts, tmp_path):
    # Node 1 sees its own empty disk at the checkpoint path (docs/multinode.md: the folder must be shared).
    folder = tmp_path / "ckpt"
    folder.mkdir()
    local = (str(folder),)
    # tp x pp: node 1 holds stage 1 and has pieces to write, into a folder rank 0 prepared on its own disk.
    codes, errs = _run_both(hosts, _train("--tp", "2", "--pp", "2", "--steps", "2", "--checkpoint-dir",
                                          str(folder)), local)
    assert all(c != 0 for c in codes), errs[0][-3000:] + errs[1][-3000:]
    assert "does not see the folder" in errs[1] and "node-local directories are not supported" in errs[1]
    assert not (folder / "latest").exists() and not list(folder.glob("step-*"))
    # dp x tp without ZeRO: node 1 is a replica with nothing to write, so the save completes on node 0 -- but
    # a resume would start node 1 from step 0 and node 0 from step 2. Every rank refuses instead.
    codes, errs = _run_both(hosts, _train("--tp", "2", "--steps", "2", "--checkpoint-dir", str(folder)), local)
    assert codes == [0, 0] and (folder / "latest").exists(), errs[0][-3000:] + errs[1][-3000:]
    codes, errs = _run_both(hosts, _train("--tp", "2", "--steps", "3", "--checkpoint-dir", str(folder),
                                          "--resume"), local)
    assert codes != [0, 0]
    for err in errs:
        assert "--resume: the ranks do not see the same checkpoint" in err, err[-3000:]
        assert "rank 2 on node1: nothing" in err and "rank 0 on node0: step-00000002" in err


def _on_own_disks(hosts, argv, folder: Path, disks: list[Path], timeout=120):
    """Both nodes, each seeing ``disks[node]`` at ``folder``; (return codes, stdouts, stderrs, seconds)."""
    port = free_port()
    procs = [_start(hosts, node, port, argv, disks={str(folder): str(disks[node])}) for node in (0, 1)]
    began = time.monotonic()
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], [o for o, _ in outs], [e for _, e in outs], time.monotonic() - began


def _node_local_run(hosts, tmp_path, steps, *extra):
    """dp 2 x tp 2 with ZeRO-1 (TP inside a node, the optimizer state sharded across the nodes), saving
    every 2 steps into node-local folders: the same path, each node's own disk under it."""
    folder = tmp_path / "ckpt"
    disks = [tmp_path / "disk0", tmp_path / "disk1"]
    for d in (folder, *disks):
        d.mkdir(exist_ok=True)
    argv = _train("--tp", "2", "--zero", "1", "--steps", str(steps), "--save-every", "2", "--checkpoint-dir",
                  str(folder), "--checkpoint-storage", "node-local", *extra)
    return folder, disks, argv


def test_node_local_checkpoints_resume_exactly_across_two_hosts(hosts, tmp_path):
    folder, disks, argv = _node_local_run(hosts, tmp_path, 4)
    codes, outs, errs, _ = _on_own_disks(hosts, argv, folder, disks)
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    first = _result(next(o for o in outs if "RESULT " in o))
    # Each node's disk holds its own ranks' files and a manifest of its own; the shared path holds nothing.
    assert not list(folder.iterdir())
    for node, disk in enumerate(disks):
        assert (disk / "latest").read_text().strip() == "step-00000004"
        files = sorted(p.name for p in (disk / "step-00000004").iterdir())
        assert files == ["manifest.json", *(f"rank-{r:05d}.safetensors" for r in (2 * node, 2 * node + 1))]
        manifest = json.loads((disk / "step-00000004" / "manifest.json").read_text())
        assert manifest["node"] == node and [n["hosts"] for n in manifest["nodes"]] == [["node0"], ["node1"]]
    _, _, more = _node_local_run(hosts, tmp_path, 6, "--resume")
    codes, outs, errs, _ = _on_own_disks(hosts, more, folder, disks)
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    resumed = _result(next(o for o in outs if "RESULT " in o))
    whole = _result(_one_host(_train("--tp", "2", "--zero", "1", "--steps", "6")))
    assert first["losses"] == whole["losses"][:4]
    assert resumed["start"] == 4 and resumed["losses"] == whole["losses"][4:]  # bit for bit


def test_a_node_local_load_that_needs_the_other_nodes_pieces_fails_on_every_rank(hosts, tmp_path):
    folder, disks, argv = _node_local_run(hosts, tmp_path, 2)
    codes, _, errs, _ = _on_own_disks(hosts, argv, folder, disks)
    assert codes == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    # The job comes back with the nodes' disks swapped (the ranks landed on the other node): both nodes
    # hold a complete copy of step 2, but each rank's optimizer shard is on the other disk.
    _, _, more = _node_local_run(hosts, tmp_path, 4, "--resume")
    codes, _, errs, took = _on_own_disks(hosts, more, folder, disks[::-1])
    assert codes[0] != 0 and codes[1] != 0
    assert took < 60, took  # an error at load, not a collective timeout
    for node, err in enumerate(errs):
        # Both ranks of the node print the same message. The two ranks share the node's stderr, and a
        # message this long (every missing piece) is more than one atomic pipe write, so their lines may
        # interleave: each rank's message is looked for in the whole text, not line by line.
        marker = "pieces that ranks need are not in their own node's folder"
        assert err.count(marker) == 2, err[-3000:]
        for r in (2 * node, 2 * node + 1):
            assert err.count(f"pyparallel train: rank {r}: checkpoint.load (node-local) of step 2") == 1, err[-3000:]
        assert "rank 0 (node0, whose folder holds node 1's pieces) needs" in err
        assert "on node 0 (node0; ranks 0, 1)" in err and "on node 1 (node1; ranks 2, 3)" in err
