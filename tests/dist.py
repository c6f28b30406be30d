"""The multi-process test harness: run a test body on N ranks over real gloo process groups.

``run(fn, world_size, *args)`` executes ``fn(*args)`` on every rank of a pool of worker processes and
returns the list of per-rank results. Pools are reused across tests (spawning and initialising costs
seconds); every rank runs with ``OMP_NUM_THREADS=1``.

Failure handling is what keeps the suite from ever hanging:

* A rank that raises reports its traceback. The other ranks get a short grace period; any still running
  are taken to be stuck in a collective their failed peer will never join, so the pool is killed (and
  respawned for the next test) and the test fails with every rank's traceback. One failing rank thus
  fails the test everywhere instead of leaving the others waiting.
* A hard per-test deadline: when it passes, each live worker's Python stack is dumped with faulthandler,
  the workers are killed, and the failure names the hung ranks and shows where they were.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback

DEFAULT_DEADLINE_S = float(os.environ.get("PYPARALLEL_TEST_DEADLINE", "180"))
GRACE_S = 5.0


def _worker_main(rank, world_size, port, conn, stderr_path):
    err = open(stderr_path, "w", buffering=1)  # noqa: SIM115 (lives as long as the worker)
    os.dup2(err.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=err, all_threads=True)
    os.environ.update({"OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=DEFAULT_DEADLINE_S))
    from torch.distributed import distributed_c10d as c10d

    import pyparallel
    from pyparallel import comm

    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, env = task
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        before = set(c10d._world.pg_map.keys())
        groups_before = set(comm._groups)
        pyparallel.reset_comm_stats()
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            # Drop the groups the test created so sockets and threads do not pile up across tests. The test's
            # models and engines can outlive it in reference cycles, and while one holds a Group the gloo
            # group lives on: its worker threads, and a socket loop that wakes every few milliseconds in
            # every idle worker, slowing every later test (80 such groups per rank by the end of the suite).
            for group in set(comm._groups) - groups_before:
                group.pg = None
            for pg in set(c10d._world.pg_map.keys()) - before:
                try:
                    dist.destroy_process_group(pg)
                except Exception:
                    pass
            gc.collect()
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` long-lived worker processes joined in one gloo process group."""

    def __init__(self, world_size: int):
        from pyparallel.launch import free_port

        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix=f"pp-pool{world_size}-")
        self.stderr_paths = [os.path.join(self.tmp, f"rank{r}.err") for r in range(world_size)]
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(r, world_size, port, child, self.stderr_paths[r]),
                            daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def stack_of(self, rank: int) -> str:
        try:
            with open(self.stderr_paths[rank]) as f:
                text = f.read()
        except OSError:
            return "(no stderr)"
        return text[-6000:]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=5)
        self.kill()

    def run(self, fn, args, env, deadline_s):
        for c in self.conns:
            c.send((fn, args, env))
        results: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + deadline_s
        first_failure = float("inf")
        while len(results) < self.world_size:
            now = time.monotonic()
            failed = any(s == "error" for s, _ in results.values())
            if failed and now > first_failure + GRACE_S:
                return results, "failed"
            if now > deadline:
                return results, "deadline"
            for r, c in enumerate(self.conns):
                if r in results:
                    continue
                if c.poll(0.05):
                    try:
                        results[r] = c.recv()
                    except EOFError:
                        results[r] = ("error", f"rank {r} died (exit code {self.procs[r].exitcode})")
                    if results[r][0] == "error" and not failed:
                        first_failure = time.monotonic()
                elif not self.procs[r].is_alive():
                    results[r] = ("error", f"rank {r} died (exit code {self.procs[r].exitcode})\n"
                                           f"{self.stack_of(r)}")
                    if not failed:
                        first_failure = time.monotonic()
        return results, "done"


_pools: dict[int, WorkerPool] = {}


def _pool(world_size: int) -> WorkerPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _pools[world_size] = WorkerPool(world_size)
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


class DistTestFailure(AssertionError):
    pass


def run(fn, world_size: int, *args, env: dict | None = None, deadline_s: float = DEFAULT_DEADLINE_S,
        fresh_after: bool = False):
    """Run ``fn(*args)`` on ``world_size`` ranks; return the per-rank results.

    ``fn`` must be a module-level function of an importable module. ``env`` is set on every rank for the
    duration of the call. ``fresh_after`` discards the pool afterwards (for tests that leave process
    groups in a broken state on purpose, e.g. a timed-out collective)."""
    pool = _pool(world_size)
    results, outcome = pool.run(fn, args, dict(env or {}), deadline_s)
    if outcome == "deadline":
        hung = [r for r in range(world_size) if r not in results]
        for r in hung:
            try:
                os.kill(pool.procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
        stacks = "\n".join(f"--- rank {r} stack ---\n{pool.stack_of(r)}" for r in hung)
        pool.kill()
        _pools.pop(world_size, None)
        raise DistTestFailure(f"{fn.__name__} on {world_size} ranks missed its {deadline_s:g} s deadline; "
                              f"hung rank(s) {hung}\n{stacks}")
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if outcome == "failed" or errors:
        stuck = [r for r in range(world_size) if r not in results]
        pool.kill()
        _pools.pop(world_size, None)
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        if stuck:
            text += f"\n(ranks {stuck} were still waiting, presumably on a peer that failed; killed)"
        raise DistTestFailure(f"{fn.__name__} failed on {world_size} ranks:\n{text}")
    if fresh_after:
        pool.close()
        _pools.pop(world_size, None)
    return [results[r][1] for r in range(world_size)]
