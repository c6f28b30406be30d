"""Where each rank of the job runs, and whether it still does: how comm.py names the peer that is gone.

Why: when a peer dies, the backend reports only what it saw (a reset connection and a port, or a timeout),
never which rank. comm.py learns every rank's host, machine and pid once, when the mesh is built
(``comm.register_processes``: an all-gather, so it stays in comm.py, DESIGN.md principle 3), and hands the
answers to :func:`record`. This module keeps that table and asks the kernel (procfs) whether a peer on this
machine still runs, so that a failed collective can say "global rank 3 (pid 4242 on this host) is no
longer running" -- or, when no peer here has died, which hosts to look at instead. The same table tells
comm.py's same-host transport (pyparallel/shm.py) whether every rank of a group shares this machine.

It issues no collective: it reads this rank's number from torch.distributed and files under /proc.
"""

from __future__ import annotations

import os
import socket
import time

import torch.distributed as dist

# Global rank -> (host name, machine key (see machine()), pid), filled once per job by record().
_processes: dict[int, tuple[str, str, int]] = {}

_PF_EXITING = 0x4  # the kernel's per-task flag (/proc/PID/stat field 9) for a task inside exit()


def machine() -> str:
    """Which pids this process can look up: the kernel's boot id and this pid namespace. Hostnames alone
    can repeat across nodes (containers), and a pid means something only inside its own namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return socket.gethostname()


def identity() -> tuple[str, str, int]:
    """This process as :func:`record` wants it from every rank: (host name, machine key, pid)."""
    return socket.gethostname(), machine(), os.getpid()


def record(ranks, found) -> None:
    """Remember ``found[i]``, an :func:`identity` gathered from every rank, as global rank ``ranks[i]``'s."""
    for r, (host, key, pid) in zip(ranks, found):
        _processes[r] = (host, key, int(pid))


def on_this_machine(ranks) -> bool:
    """Whether every one of ``ranks`` is recorded and runs on this machine (False before :func:`record`)."""
    here = machine()
    return all(r in _processes and _processes[r][1] == here for r in ranks)


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process. Not: a zombie (dead, not yet reaped by its parent), nor a process
    already inside exit() -- the kernel closes a killed process's sockets (the reset its peers read) before
    it turns into a zombie, so a survivor can look in that window."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] not in ("Z", "X") and not int(fields[6]) & _PF_EXITING
    except FileNotFoundError:
        return False
    except OSError:  # no procfs (macOS): existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def gone(group) -> list[tuple[int, int]]:
    """(global rank, pid) of the group's peers on this machine that are no longer running."""
    here, me = machine(), dist.get_rank()
    return [(r, _processes[r][2]) for r in group.ranks
            if r != me and r in _processes and _processes[r][1] == here and not running(_processes[r][2])]


def blame_peers(group) -> str:
    """Who to blame for a failure on ``group``: the peers here that are gone, else the other hosts whose
    peers may have died; "" when nothing is known (ranks not recorded)."""
    dead = gone(group)
    if dead:
        me = socket.gethostname()
        return "; ".join(f"global rank {r} (pid {pid} on {'this host' if _processes[r][0] == me else _processes[r][0]})"
                         f" is no longer running" for r, pid in dead)
    here = machine()
    elsewhere: dict[str, list[int]] = {}
    for r in group.ranks:
        if r in _processes and _processes[r][1] != here:
            elsewhere.setdefault(_processes[r][0], []).append(r)
    if elsewhere:
        where = ", ".join(f"{host} (global ranks {', '.join(map(str, ranks))})" for host, ranks in
                          sorted(elsewhere.items()))
        return f"no peer on this host has died; peers on {where} may have"
    return ""


def blame_lost_peer(group, wait_s: float = 2.0) -> str:
    """:func:`blame_peers` for a connection a peer reset: the peer is dying or dead, so when none on this host
    looks gone yet, look again for a moment (its exit may still be in progress) before blaming elsewhere."""
    deadline = time.monotonic() + wait_s
    while not gone(group) and time.monotonic() < deadline and any(
            r in _processes and _processes[r][1] == machine() for r in group.ranks if r != dist.get_rank()):
        time.sleep(0.05)
    return blame_peers(group)
