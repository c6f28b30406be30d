"""Kill-point harness for ``checkpoint.save`` (run by tests/test_faults.py as its own process).

For every kill point of ``save`` (``checkpoint.store._kill_point``) on rank 0 and on rank 1, and for both a
new step and a re-save of the newest step: step 1 is saved (world of one, weights = 1), then a 2-rank save
(weights = 2, half of the tensor written by each rank) is started and the chosen rank SIGKILLs itself at
the chosen point. Then the root must hold a ``latest`` that names a complete, checksum-clean checkpoint
holding exactly the old or exactly the new weights (the new ones once rank 0 has replaced ``latest``), the
survivor must have ended by itself, and the next saves must leave no ``.tmp-step-*`` folder and one folder
per step. Prints one JSON line per case; the parent test asserts on them.

The two ranks are forked from this process (torch is imported once; no thread exists yet), so a case costs
a fraction of a second instead of two interpreter start-ups.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import pyparallel  # noqa: E402
from pyparallel import checkpoint  # noqa: E402
from pyparallel.checkpoint import Piece, store  # noqa: E402
from pyparallel.launch import free_port  # noqa: E402

ROWS, COLS = 8, 4
RANK0_POINTS = ["start", "prepared", "written", "manifest", "renamed", "latest-written", "latest", "done"]
RANK1_POINTS = ["start", "prepared", "written", "done"]
# Where the new checkpoint has become `latest`: rank 0 replaced the pointer, or rank 1 died only after its
# data file reached the manifest (rank 0 then commits, and reports the lost peer afterwards).
NEW_AFTER = {0: {"latest", "done"}, 1: {"written", "done"}}
DEADLINE_S = 30.0


class Halves(nn.Module):
    """One global [8, 4] tensor; on 2 ranks each holds and writes its half of the rows."""

    def __init__(self, value: float, rank: int = 0, world: int = 1, mesh=None):
        super().__init__()
        rows = ROWS // world
        self.w = nn.Parameter(torch.full((rows, COLS), value))
        self.rank, self.rows, self.mesh = rank, rows, mesh

    def checkpoint_pieces(self):
        box = Piece("model/w", (ROWS, COLS), (self.rank * self.rows, 0), (self.rows, COLS), owner=True)
        return [(box, self.w)]


def _child(root: str, step: int, rank: int, port: int, kill: tuple[int, str]) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    code = 0
    try:
        mesh = pyparallel.init(timeout_s=10)
        if rank == kill[0]:
            store._kill_point = lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == kill[1] else None
        checkpoint.save(root, Halves(2.0, rank, 2, mesh), step=step, mesh=mesh)
    except BaseException:  # the survivor of a killed peer: an error is the expected way out
        code = 3
    os._exit(code)


def _pair(root: str, step: int, kill: tuple[int, str]) -> dict:
    port = free_port()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            _child(root, step, rank, port, kill)
        pids.append(pid)
    status, t0 = {}, time.monotonic()
    while len(status) < 2 and time.monotonic() - t0 < DEADLINE_S:
        for rank, pid in enumerate(pids):
            if rank not in status:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[rank] = os.waitstatus_to_exitcode(st)
        time.sleep(0.01)
    hung = [r for r in range(2) if r not in status]
    for r in hung:
        os.kill(pids[r], signal.SIGKILL)
        os.waitpid(pids[r], 0)
    return {"status": status, "hung": hung, "seconds": round(time.monotonic() - t0, 2)}


def _weights(root: str) -> tuple[int, float]:
    folder = checkpoint.resolve(root)
    manifest = checkpoint.read_manifest(folder)  # checksums verified
    w = checkpoint.read_tensors(folder)["model/w"]
    values = w.unique().tolist()
    return manifest["step"], values[0] if len(values) == 1 else values


def _case(base: str, resave: bool, kill: tuple[int, str]) -> dict:
    root = os.path.join(base, f"{'resave' if resave else 'new'}-r{kill[0]}-{kill[1]}")
    checkpoint.save(root, Halves(1.0), step=1)
    step = 1 if resave else 2
    out = {"resave": resave, "rank": kill[0], "point": kill[1], **_pair(root, step, kill)}
    out["after_kill"] = _weights(root)
    out["tmp_after_kill"] = sorted(e for e in os.listdir(root) if e.startswith(".tmp"))
    out["expect"] = [step, 2.0] if kill[1] in NEW_AFTER[kill[0]] else [1, 1.0]
    # The next save of another step removes the killed save's leftovers; a save of the same step again
    # replaces every older copy of it.
    checkpoint.save(root, Halves(3.0), step=5)
    out["tmp_left"] = sorted(e for e in os.listdir(root) if e.startswith(".tmp"))
    checkpoint.save(root, Halves(4.0), step=step)
    out["after_recovery"] = _weights(root)
    out["entries"] = sorted(os.listdir(root))
    return out


def main(base: str) -> None:
    cases = [(0, p) for p in RANK0_POINTS] + [(1, p) for p in RANK1_POINTS]
    for resave in (False, True):
        for kill in cases:
            print(json.dumps(_case(base, resave, kill)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
