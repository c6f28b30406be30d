"""Run a function in N local processes without torchrun (tests, ``pyparallel bench``, examples).

Each process gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT on a free loopback port), so the same function runs unchanged under torchrun. The function
calls ``pyparallel.init(...)`` itself. ``launch`` returns every rank's return value, or raises
:class:`LaunchError` carrying the traceback of the first rank that failed; the other ranks are stopped
rather than left waiting in a collective.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


class LaunchError(RuntimeError):
    """A launched rank raised or died; ``rank`` and the remote ``traceback`` are attached."""

    def __init__(self, message: str, rank: int, remote_traceback: str):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, nprocs, port, args, kwargs, env, results):
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        import torch

        if "OMP_NUM_THREADS" in env:
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        value = fn(*args, **kwargs)
        results.put((rank, "ok", value))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def launch(fn, nprocs: int, args: tuple = (), kwargs: dict | None = None, *, env: dict | None = None,
           timeout_s: float | None = None, grace_s: float = 10.0) -> list:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` fresh processes and return their results by rank.

    ``fn`` must be importable (a module-level function). ``env`` adds environment variables to every
    process; ``OMP_NUM_THREADS`` defaults to ``cpu_count // nprocs`` so ranks do not oversubscribe cores.
    ``timeout_s`` bounds the whole run. When a rank fails, the others get ``grace_s`` seconds to finish
    (or fail too) before they are terminated.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, nprocs, port, args, kwargs or {}, env, results), daemon=False)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    failure: tuple[int, str] | None = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    fail_deadline = None
    try:
        while len(out) < nprocs:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                failure = failure or (-1, f"launch: timed out after {timeout_s:g} s with ranks "
                                          f"{sorted(set(range(nprocs)) - set(out))} still running")
                break
            if fail_deadline is not None and now > fail_deadline:
                break
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and not p.is_alive() and p.exitcode not in (0, None):
                        # Died without reporting (killed, segfault, os._exit).
                        out[r] = None
                        if failure is None:
                            failure = (r, f"rank {r} exited with code {p.exitcode} without reporting a result")
                            fail_deadline = time.monotonic() + grace_s
                continue
            out[rank] = value
            if status == "error" and failure is None:
                failure = (rank, value)
                fail_deadline = time.monotonic() + grace_s
    finally:
        for p in procs:
            p.join(timeout=grace_s if failure is None else 1.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if failure is not None:
        rank, text = failure
        raise LaunchError(f"rank {rank} failed:\n{text}", rank, text)
    return [out[r] for r in range(nprocs)]
