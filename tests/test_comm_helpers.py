"""comm.py's pure helpers on their own, in one process: the liveness table that names a lost peer and debug
mode's fingerprint rows (the multi-process tests in test_errors.py and test_peer_loss.py cover them end to end)."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from pyparallel import fingerprint, liveness


def test_running_is_false_for_a_zombie_and_a_missing_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while liveness.running(child.pid) and time.monotonic() < deadline:  # exited, not yet reaped: a zombie
            time.sleep(0.02)
        assert not liveness.running(child.pid)
    finally:
        child.wait()
    assert not liveness.running(child.pid)  # reaped: no such pid
    assert liveness.running(os.getpid())


def test_blame_names_a_dead_peer_here_else_the_other_hosts(monkeypatch):
    here, me = liveness.machine(), liveness.identity()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setattr(liveness.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(liveness, "_processes", {})
    liveness.record([0, 1, 2], [me, (me[0], here, dead.pid), ("node-b", "other-machine", 7)])
    group = SimpleNamespace(ranks=(0, 1, 2))
    assert liveness.gone(group) == [(1, dead.pid)]
    assert liveness.blame_peers(group) == f"global rank 1 (pid {dead.pid} on this host) is no longer running"
    assert not liveness.on_this_machine(group.ranks) and liveness.on_this_machine((0, 1))

    group = SimpleNamespace(ranks=(0, 2))
    assert liveness.blame_lost_peer(group) == "no peer on this host has died; peers on node-b (global ranks 2) may have"
    assert liveness.blame_peers(SimpleNamespace(ranks=(0, 5))) == ""  # rank 5 never recorded: nothing to say


def test_fingerprint_rows_agree_only_on_the_same_call():
    a = fingerprint.encode("all_reduce", 3, torch.zeros(2, 5))
    assert len(a) == fingerprint.LENGTH and fingerprint.decode(a) == (
        "call #3 all_reduce(shape=(2, 5), dtype=torch.float32)")
    assert fingerprint.disagreement([a, list(a)], (0, 1)) == ""
    b = fingerprint.encode("all_reduce", 3, torch.zeros(2, 5, dtype=torch.bfloat16))
    assert fingerprint.disagreement([a, b], (4, 6)) == (
        "rank 4: call #3 all_reduce(shape=(2, 5), dtype=torch.float32); "
        "rank 6: call #3 all_reduce(shape=(2, 5), dtype=torch.bfloat16)")
    assert fingerprint.decode(fingerprint.encode("barrier", 1, None)) == "call #1 barrier(shape=(), dtype=0)"
