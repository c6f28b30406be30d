"""Run a function in N local processes without torchrun (tests, ``pyparallel bench``, examples).

Each process gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT on a free loopback port), so the same function runs unchanged under torchrun. The function
calls ``pyparallel.init(...)`` itself. ``launch`` returns every rank's return value, or raises
:class:`LaunchError` naming the rank that failed first; the other ranks are stopped rather than left
waiting in a collective.

Results travel as plain pickles, written by the child through its own pipe before it exits: a tensor is
copied into the message, not shared through a file descriptor of a process that may be gone by the time
the parent reads it (what ``multiprocessing``'s queue does with torch tensors).

Blame: when a rank dies or raises, its peers usually fail a moment later in a collective ("connection
closed by peer"). The rank named is the first one that died without a result (with its exit code or
signal) or raised anything but a collective error; only when every failure is a collective error is the
first of those named.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait as _wait_any


class LaunchError(RuntimeError):
    """A launched rank raised or died.

    ``rank``: the rank blamed (-1 for a timeout); ``remote_traceback``: its traceback (or the description
    of its death); ``summary``: one line; ``exit_code`` / ``signal``: how a rank that died without a
    result ended; ``exc_type`` / ``exc_message``: what a rank that raised raised; ``others``: one line per
    other rank that failed after it."""

    def __init__(self, message: str, rank: int, remote_traceback: str, *, summary: str | None = None,
                 exit_code: int | None = None, signal: str | None = None, exc_type: str | None = None,
                 exc_message: str | None = None, others: list[str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.summary = summary or message.splitlines()[0]
        self.exit_code = exit_code
        self.signal = signal
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.others = others or []


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_COLLECTIVE_TYPES = ("CollectiveError", "CollectiveTimeoutError", "DistBackendError", "DistNetworkError")
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe")


def _is_collective(exc: BaseException) -> bool:
    """A failure that is usually the consequence of another rank's (a lost peer, a timed-out collective).
    A mismatch found by debug fingerprints is a cause, not a consequence."""
    name = type(exc).__name__
    if name == "CollectiveMismatchError":
        return False
    return name in _COLLECTIVE_TYPES or any(s in str(exc).lower() for s in _PEER_LOST)


def _worker(fn, rank, nprocs, port, args, kwargs, env, conn):
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
    ok = False
    try:
        import torch

        if "OMP_NUM_THREADS" in env:
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        value = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(f"the return value of {getattr(fn, '__name__', fn)} on rank {rank} cannot be "
                            f"pickled ({type(exc).__name__}: {exc}); return plain data") from exc
        ok = True
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        info = {"traceback": traceback.format_exc(), "type": type(exc).__name__, "message": str(exc),
                "collective": _is_collective(exc)}
        payload = pickle.dumps(("error", info), protocol=pickle.HIGHEST_PROTOCOL)
    try:
        conn.send_bytes(payload)  # synchronous: in the pipe before this process can exit
        conn.close()
    except OSError:  # the parent is gone: nobody to report to
        pass
    if not ok:
        # Do not tear down the process group after a failure: its destructor waits for in-flight work
        # with peers that may be dead (bounded only by the group timeout). Nothing is left to flush.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    try:
        from pyparallel.mesh import shutdown

        shutdown()
    except Exception:
        pass


def _death(rank: int, code: int | None) -> tuple[str, int | None, str | None]:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name} before returning a result", code, name
    return f"rank {rank} exited with code {code} before returning a result", code, None


def launch(fn, nprocs: int, args: tuple = (), kwargs: dict | None = None, *, env: dict | None = None,
           timeout_s: float | None = None, grace_s: float = 10.0) -> list:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` fresh processes and return their results by rank.

    ``fn`` must be importable (a module-level function); its results must be picklable (tensors are
    fine: they are copied). ``env`` adds environment variables to every process; ``OMP_NUM_THREADS``
    defaults to ``cpu_count // nprocs`` so ranks do not oversubscribe cores. ``timeout_s`` bounds the
    whole run. When a rank fails, the others get ``grace_s`` seconds to finish (or fail too) before they
    are terminated.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    ctx = mp.get_context("spawn")
    port = free_port()
    readers, procs = [], []
    for r in range(nprocs):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(fn, r, nprocs, port, args, kwargs or {}, env, writer), daemon=False)
        readers.append(reader)
        procs.append((p, writer))
    for p, _ in procs:
        p.start()
    for _, writer in procs:
        writer.close()  # the child holds the only writing end: EOF once it is gone
    procs = [p for p, _ in procs]
    out: dict[int, object] = {}
    failures: list[tuple[float, int, dict]] = []  # (when seen, rank, what)
    try:
        timed_out = _collect(procs, readers, out, failures, timeout_s, grace_s)
    finally:
        for p in procs:
            p.join(timeout=grace_s if not failures else 1.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for reader in readers:
            reader.close()
    if failures:
        raise _blame(failures, [r for r in range(nprocs) if r not in out and r not in {f[1] for f in failures}])
    if timed_out:
        running = sorted(set(range(nprocs)) - set(out))
        text = f"launch: timed out after {timeout_s:g} s with ranks {running} still running"
        raise LaunchError(text, -1, text)
    return [out[r] for r in range(nprocs)]


def _collect(procs, readers, out: dict, failures: list, timeout_s, grace_s) -> bool:
    """Read results and notice deaths until every rank is accounted for, the deadline passes (returns
    True), or ``grace_s`` after the first failure."""
    nprocs = len(procs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    fail_deadline = None
    pending = set(range(nprocs))
    closed: set[int] = set()  # pipes closed without a message by a rank still alive
    while pending:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            return True
        if fail_deadline is not None and now > fail_deadline:
            return False
        waitables = {readers[r]: r for r in pending - closed}
        waitables.update({procs[r].sentinel: r for r in pending})
        for obj in _wait_any(list(waitables), timeout=0.2):
            r = waitables[obj]
            if r not in pending:
                continue
            message = _read(readers[r])
            if message is None and obj is readers[r] and procs[r].is_alive():
                closed.add(r)  # EOF while still alive: wait for its exit
                continue
            if message is None:
                procs[r].join(timeout=5)
                text, code, sig = _death(r, procs[r].exitcode)
                failures.append((time.monotonic(), r, {"summary": text, "traceback": text, "exit_code": code,
                                                       "signal": sig, "collective": False}))
            elif message[0] == "ok":
                out[r] = message[1]
            else:
                info = message[1]
                failures.append((time.monotonic(), r, {**info, "summary": f"rank {r} raised {info['type']}: "
                                                                          f"{_first_line(info['message'])}"}))
            pending.discard(r)
            if failures and fail_deadline is None:
                fail_deadline = time.monotonic() + grace_s
    return False


def _read(reader):
    """One rank's message, or None when its pipe is closed without one (it died)."""
    try:
        if not reader.poll():
            return None
        data = reader.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        return pickle.loads(data)
    except Exception as exc:  # e.g. a class the parent cannot import
        return ("error", {"traceback": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__,
                          "message": f"its result could not be unpickled in the parent: {exc}",
                          "collective": False})


def _first_line(text: str) -> str:
    lines = [x for x in str(text).strip().splitlines() if x.strip()]
    return lines[0] if lines else ""


def _blame(failures: list, stopped: list[int]) -> LaunchError:
    causes = [f for f in failures if not f[2]["collective"]] or failures
    _, rank, what = min(causes, key=lambda f: f[0])
    others = [f[2]["summary"] for f in sorted(failures, key=lambda f: f[0]) if f[1] != rank]
    if stopped:
        others.append(f"ranks {stopped} were still running and were stopped")
    message = f"rank {rank} failed: {what['summary']}"
    if others:
        message += " (then: " + "; ".join(others) + ")"
    if "type" in what:
        message += "\n" + what["traceback"]
    return LaunchError(message, rank, what["traceback"], summary=what["summary"], exit_code=what.get("exit_code"),
                       signal=what.get("signal"), exc_type=what.get("type"), exc_message=what.get("message"),
                       others=others)
