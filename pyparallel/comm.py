"""The one door to the network: every ``torch.distributed`` collective pyparallel issues goes through here.

Why one module (DESIGN.md, principle 3):

* **Accounting.** Each call is counted per op and per mesh axis (calls, payload and wire bytes) in
  ``pyparallel/accounting.py``; ``comm_stats()`` returns the totals, ``reset_comm_stats()`` zeroes them.
* **Bounded waits.** Groups are created with a timeout; a collective that does not complete in time
  raises :class:`CollectiveTimeoutError` naming the op, the group, its ranks and this rank, instead of
  hanging or aborting the process. A lost connection names the peer by global rank: each rank's host
  and pid are learned once when the mesh is built (:func:`register_processes`), so a peer on this host
  that is no longer running is named, not just the port the backend saw (``pyparallel/liveness.py`` keeps
  that table and asks /proc who is still running).
* **Backend gaps.** Some ops are missing on some backends (gloo had no ReduceOp.AVG and no
  reduce-scatter before torch 2.7; torch 2.13 renamed ``*_tensor`` to ``*_single``). Each gap is probed
  once per backend by attempting the op (unsupported ops fail on entry, before any byte moves, on every
  rank alike) and the fallback is remembered.
* **Debug fingerprints.** With ``PYPARALLEL_DEBUG=1`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) every
  collective is preceded by an all-gather of (sequence number, op, dtype, shape); ranks that disagree all
  fail at once with every rank's side named (the rows' encoding and comparison: ``pyparallel/fingerprint.py``).

Those helper modules hold only pure logic; every call that moves bytes stays here.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pyparallel import accounting, device, fingerprint, liveness, shm
from pyparallel.accounting import comm_stats, reset_comm_stats  # noqa: F401  (re-exported)
from pyparallel.fingerprint import debug_enabled  # also comm.debug_enabled, as before

DEFAULT_TIMEOUT_S = 300.0

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, closed its connection, or the backend reported an error."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the group's timeout: some rank never joined it."""


class CollectiveMismatchError(CollectiveError):
    """(Debug mode) ranks called different collectives, or the same one with different shapes/dtypes."""


@dataclass(eq=False)
class Group:
    """A process group together with what pyparallel needs to talk about it.

    ``name`` is the mesh axis ("dp", "tp", "pp", "world", ...) used for accounting and error messages;
    ``ranks`` are global ranks in group order; ``rank`` is this process's index within the group.
    """

    pg: object
    name: str
    ranks: tuple[int, ...]
    timeout_s: float
    backend: str
    seq: int = field(default=0)
    label: str | None = None  # how errors describe the group when its rank order means something
    # The same-host shared-memory transport (pyparallel/shm.py): None until first needed, False where the
    # group cannot use one (another host, another backend, no space, PYPARALLEL_SHM=0).
    arena: object = field(default=None, repr=False)
    # gloo receives, waited for in posting order by a helper thread (_ReceiveWaiter): None until the first.
    receive_waiter: object = field(default=None, repr=False)
    # A two-rank group's point-to-point messages through shared memory (shm.Channel): as ``arena``.
    channel: object = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank())

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={list(self.ranks)})"

    # A group names a communicator shared by every module that uses it: copying a module (deepcopy for
    # meta-device shape inference, EMA copies) must share the group, not try to clone a process group.
    def __copy__(self) -> Group:
        return self

    def __deepcopy__(self, memo) -> Group:
        return self


def new_group(ranks, name: str, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None, *,
              label: str | None = None) -> Group | None:
    """Create a process group over ``ranks`` (a collective over the world: every rank must call it, in the
    same order, for every group). Returns the Group on its members and None elsewhere. ``label`` replaces
    the rank list in error messages (e.g. a pipeline link "global rank 1 sends to global rank 0")."""
    ranks = tuple(int(r) for r in ranks)
    backend = backend or dist.get_backend()
    pg = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
    if dist.get_rank() not in ranks:
        return None
    group = Group(pg=pg, name=name, ranks=ranks, timeout_s=timeout_s, backend=backend, label=label)
    _groups.add(group)
    return group


_groups: weakref.WeakSet[Group] = weakref.WeakSet()  # every live Group new_group made, for close_groups


def close_groups() -> None:
    """Drop every pyparallel Group's reference to its process group (then, with torch.distributed's own
    references gone, the process group is destroyed and joins its worker threads). A Group is unusable
    afterwards. Part of ``pyparallel.shutdown``: a gloo group that outlives the interpreter's finalization
    can still be releasing a finished collective's tensors on its worker thread, which then needs the GIL
    of an interpreter that is going away and aborts the process (pytorch/pytorch#190489)."""
    for group in list(_groups):
        group.pg = None
    _groups.clear()


def _open(op: str, group: Group) -> None:
    if group.pg is None:
        raise RuntimeError(f"{op} on the {group.name} group {list(group.ranks)} after pyparallel.shutdown(): "
                           "its process group is gone; call pyparallel.init() again for a new mesh")


def register_processes(group: Group) -> None:
    """Learn every rank's host and pid (one small all-gather over ``group``, the world), so that a lost
    connection can be blamed on the global rank that is gone (pyparallel/liveness.py)."""
    found = [liveness.identity()] * group.size
    if group.size > 1:
        try:  # not counted in group.seq: the user's first collective stays call #1 in messages
            dist.all_gather_object(found, found[0], group=group.pg)
        except Exception as exc:
            raise _translate(exc, "all_gather_object", group, 0) from exc
    liveness.record(group.ranks, found)


# ------------------------------------------------------------------------------------------ accounting


def _account(op: str, group: Group, payload_bytes: int) -> None:
    accounting.account(op, group.name, group.size, payload_bytes)


# ------------------------------------------------------------------------------------ errors, timeouts


def _describe(op: str, group: Group, seq: int) -> str:
    members = group.label or f"global ranks {list(group.ranks)}"
    return f"{op} on group '{group.name}' ({members}), call #{seq} on this group, rank {dist.get_rank()}"


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def _translate(exc: Exception, op: str, group: Group, seq: int) -> CollectiveError:
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else ""
    where = _describe(op, group, seq)
    if "timed out" in text.lower() or "timeout" in text.lower():
        blame = liveness.blame_peers(group)
        return CollectiveTimeoutError(
            f"pyparallel: {where} did not complete within {group.timeout_s:g} s: a peer rank never joined"
            f"{f' ({blame})' if blame else ''}. Check that every rank of the group calls the same collectives "
            f"in the same order (set PYPARALLEL_DEBUG=1 to compare them). Backend said: {first}"
        )
    if any(s in text.lower() for s in _PEER_LOST):
        blame = liveness.blame_lost_peer(group) or "the peer's global rank could not be determined from here"
        return CollectiveError(f"pyparallel: {where} failed: lost the connection to a peer: {blame}. "
                               f"Backend said: {first}")
    return CollectiveError(f"pyparallel: {where} failed: {text}")


class Handle:
    """An in-flight collective. ``wait()`` blocks until done and applies any fallback post-processing."""

    def __init__(self, work, op: str, group: Group, seq: int, finish=None):
        self._work = work
        self._op = op
        self._group = group
        self._seq = seq
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        try:
            if self._work is None:
                pass
            elif self._group.backend == "nccl":
                # NCCL's watchdog would abort the process at the group timeout; waiting with the same
                # bound raises here first, as a Python exception we can name.
                self._work.wait(timeout=datetime.timedelta(seconds=self._group.timeout_s))
            else:  # gloo enforces the group's timeout inside the op and raises
                self._work.wait()
        except Exception as exc:  # gloo/NCCL raise RuntimeError or DistBackendError
            raise _translate(exc, self._op, self._group, self._seq) from exc
        if self._finish is not None:
            self._finish()
        self._done = True
        self._work = self._finish = None  # the backend's work holds its tensors and communicator: let go now

    def is_completed(self) -> bool:
        return self._done or (self._work is None or self._work.is_completed())


class _WaitedHandle(Handle):
    """A gloo receive whose completion can be asked without blocking.

    gloo marks a receive's work complete only inside ``wait()``: ``is_completed()`` stays False after the
    data has arrived, so a pipeline stage asking whether a message is there (to run a deferred W instead of
    waiting, pipeline_parallel/engine.py) would always hear no. The group's :class:`_ReceiveWaiter` thread
    waits for the work instead and sets ``_arrived``; ``wait()`` waits for that (the thread's wait enforces
    the group's timeout, and its error is raised here, named like any other)."""

    def __init__(self, work, op: str, group: Group, seq: int):
        super().__init__(work, op, group, seq)
        self._arrived = threading.Event()
        self._error: BaseException | None = None

    def wait(self) -> None:
        if self._done:
            return
        self._arrived.wait()
        if self._error is not None:
            raise _translate(self._error, self._op, self._group, self._seq) from self._error
        self._done = True
        self._work = None

    def is_completed(self) -> bool:
        return self._done or self._arrived.is_set()


class _ReceiveWaiter:
    """One daemon thread per gloo group carrying receives: waits for them in posting order — the order in
    which point-to-point messages between two ranks arrive — with the GIL released inside gloo's wait."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="pyparallel-recv-waiter", daemon=True).start()

    def submit(self, handle: _WaitedHandle) -> None:
        self._queue.put(handle)

    def _loop(self) -> None:
        while True:
            handle = self._queue.get()
            try:
                handle._work.wait()
            except Exception as exc:  # the main thread raises it, translated, from handle.wait()
                handle._error = exc
            handle._arrived.set()


def _run(op: str, group: Group, payload_bytes: int, issue, async_op: bool, fp_tensor=None):
    """Count, optionally fingerprint, issue and (unless async) wait for one collective.

    ``issue()`` returns ``(work, finish)``: the backend's work object and an optional callable that
    completes a fallback (a divide for AVG, a slice copy for reduce-scatter) once the work is done."""
    _open(op, group)
    group.seq += 1
    seq = group.seq
    if debug_enabled() and group.size > 1:
        _check_fingerprint(op, group, seq, fp_tensor)
    _account(op, group, payload_bytes)
    work, finish = None, None
    if group.size > 1:
        try:
            work, finish = issue()
        except CollectiveError:
            raise
        except Exception as exc:
            raise _translate(exc, op, group, seq) from exc
    handle = Handle(work, op, group, seq, finish)
    if async_op:
        return handle
    handle.wait()
    return None


# ------------------------------------------------------------------------------ backend feature tests

_unsupported: dict[tuple[str, str], bool] = {}


def _try_native(feature: str, group: Group, attempt):
    """Run ``attempt()``; if the backend rejects the feature on entry, remember and return None."""
    key = (group.backend, feature)
    if _unsupported.get(key):
        return None
    try:
        return attempt()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        text = str(exc).lower()
        if any(s in text for s in ("not support", "unsupported", "cannot use", "not implemented")):
            _unsupported[key] = True
            return None
        raise


def _all_gather_single():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------- collectives


def _same_dtype(op: str, group: Group, output: torch.Tensor, tensor: torch.Tensor) -> None:
    if output.dtype != tensor.dtype:
        raise ValueError(f"{op} on group '{group.name}': output dtype {output.dtype} differs from input "
                         f"dtype {tensor.dtype}")


def _op(name: str):
    if name not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce op {name!r}; choose one of {sorted(_REDUCE_OPS)}")
    return _REDUCE_OPS[name]


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group``. ``op`` is sum, avg, max, min or product."""
    red = _op(op)

    def issue():
        arena = _arena_for(group, tensor, op)
        if arena is not None:
            arena.all_reduce(tensor.view(-1), _shm_combine(op), op == "avg", _on_stall("all_reduce", group))
            return None, None
        if op == "avg":
            work = _try_native("avg", group, lambda: dist.all_reduce(tensor, red, group=group.pg, async_op=True))
            if work is not None:
                return work, None
            # gloo before torch 2.7: sum, then divide.
            work = dist.all_reduce(tensor, _op("sum"), group=group.pg, async_op=True)
            return work, lambda: tensor.div_(group.size)
        return dist.all_reduce(tensor, red, group=group.pg, async_op=True), None

    nbytes = tensor.numel() * tensor.element_size()
    return _run("all_reduce", group, nbytes, issue, async_op, fp_tensor=tensor)


# Direct paths for gloo's two slowest collectives (benchmarks/comm.py measures them against torch's own):
# * all-gather: gloo's ring goes through intermediate buffers; N concurrent one-to-all broadcasts, each rank's
#   slice straight into its place in the output, move the same (N-1)/N of the output per rank: 1.2x faster
#   at 14 MB on 2 and 4 ranks over loopback, with 30-35% less CPU time; even at 1 MB, slower below that
#   (N message latencies);
# * reduce-scatter: gloo's is an all-reduce of a clone, 2(N-1)/N of the input on the wire per rank, twice the
#   minimum; a direct exchange (rank r sends slice j to rank j and adds the slices it receives, in rank
#   order) moves (N-1)/N: 2.3-2.4x faster at 14 MB, and faster from 256 KiB on.
_GLOO_GATHER_BYTES = 1 << 20
_GLOO_EXCHANGE_BYTES = 256 * 1024


class _Works:
    """Several backend works completed together (one collective issued as a few calls)."""

    def __init__(self, works):
        self._works = works

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait() if timeout is None else w.wait(timeout=timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def _gather_by_broadcasts(output: torch.Tensor, tensor: torch.Tensor, group: Group) -> _Works:
    slots = output.view(group.size, -1)
    mine = slots[group.rank]
    src = tensor.reshape(-1)
    if src.data_ptr() != mine.data_ptr():
        mine.copy_(src)
    return _Works([dist.broadcast(slots[i], group.ranks[i], group=group.pg, async_op=True)
                   for i in range(group.size)])


_COMBINE = {"sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "max": lambda a, b: torch.maximum(a, b, out=a),
            "min": lambda a, b: torch.minimum(a, b, out=a), "product": torch.Tensor.mul_}


def _gloo_direct(group: Group, tensor: torch.Tensor, min_bytes: int) -> bool:
    """Take a direct path: gloo, a tensor of ``min_bytes`` or more, a dtype whose reduction is arithmetic."""
    return (group.backend == "gloo" and tensor.numel() * tensor.element_size() >= min_bytes
            and tensor.dtype != torch.bool)


def _reduce_scatter_by_exchange(out: torch.Tensor, flat: torch.Tensor, group: Group, op: str):
    """Start the exchange; returns (works, finish) where ``finish`` combines the received slices into
    ``out`` (which may be ``flat``'s own slice r: nothing else of ``flat`` is written)."""
    n, r = group.size, group.rank
    slices = flat.view(n, -1)
    peers = [j for j in range(n) if j != r]
    received = torch.empty((n - 1, slices.shape[1]), dtype=flat.dtype, device=flat.device)
    tag = group.seq % (1 << 24)  # the same on every rank: this exchange's messages match only each other
    works = []
    for k, j in enumerate(peers):
        works.append(dist.isend(slices[j], group.ranks[j], group=group.pg, tag=tag))
        works.append(dist.irecv(received[k], group.ranks[j], group=group.pg, tag=tag))

    def finish():
        mine = out.view(-1)
        if mine.data_ptr() != slices[r].data_ptr():
            mine.copy_(slices[r])
        for k in range(n - 1):  # peers in rank order: the result does not depend on arrival order
            _COMBINE[op](mine, received[k])
        if op == "avg":
            mine.div_(n)

    return _Works(works), finish


# ------------------------------------------------------------------- same-host shared-memory transport
# A gloo group whose ranks all run on this machine moves its collectives through shared memory instead of
# loopback TCP (pyparallel/shm.py says why and how). Which collectives go that way depends only on what every
# rank of the group sees alike (the group, the tensor's size and dtype), so the ranks always agree. Set
# PYPARALLEL_SHM=0 to keep everything on the backend (to compare, or where /dev/shm is too small).


def _shm_wanted(group: Group) -> bool:
    if group.backend != "gloo" or group.size < 2 or os.environ.get("PYPARALLEL_SHM", "1").lower() in (
            "0", "false", "no", "off"):
        return False
    if not liveness.on_this_machine(group.ranks):
        return False  # a peer on another host (or ranks not registered yet: register_processes)
    from pyparallel import _ops

    return _ops.has_kernel("shm_wait", torch.device("cpu"))


def _open_arena(group: Group, create=None, attach=None):
    """Create the group's mapping (group rank 0), map it everywhere, agree that every rank did, unlink it.
    Two small collectives over the group, on every rank at the same point of the program. ``create()`` /
    ``attach(path)``: another kind of mapping than the collectives' arena (a point-to-point channel)."""
    n = group.size
    capacity = shm.region_bytes(n)
    create = create or (lambda: shm.create(n, capacity))
    attach = attach or (lambda path: shm.Arena(path, n, group.rank, capacity))
    name = [create() if group.rank == 0 else None]
    dist.broadcast_object_list(name, src=group.ranks[0], group=group.pg)
    arena = None
    if name[0] is not None:
        try:
            arena = attach(name[0])
        except (OSError, ValueError):
            arena = None
    ok = torch.tensor([1 if arena is not None else 0], dtype=torch.int32)
    dist.all_reduce(ok, dist.ReduceOp.MIN, group=group.pg)
    if group.rank == 0 and name[0] is not None:
        os.unlink(name[0])  # every rank has it mapped (or has given up): nothing is left behind on a crash
    return arena if int(ok) == 1 else False


def _arena_for(group: Group, tensor: torch.Tensor, op: str | None = None):
    """The group's shared-memory arena if this collective takes that path, else None."""
    if (group.arena is False or tensor.device.type != "cpu" or not tensor.is_contiguous()
            or tensor.dtype == torch.bool or (op is not None and op not in _COMBINE)):
        return None
    if group.arena is None:
        if not _shm_wanted(group):
            group.arena = False
            return None
        group.arena = _open_arena(group)
    return group.arena or None


def _on_stall(op: str, group: Group):
    """What a shared-memory wait does every half second while a peer is behind: name a peer that died,
    or, past the group's timeout, the one that never arrived."""
    seq = group.seq

    def stalled(late: int, waited_s: float) -> None:
        where = _describe(op, group, seq)
        if liveness.gone(group):
            raise CollectiveError(f"pyparallel: {where} failed: lost a peer: {liveness.blame_peers(group)}")
        if waited_s >= group.timeout_s:
            raise CollectiveTimeoutError(
                f"pyparallel: {where} did not complete within {group.timeout_s:g} s: a peer rank never joined "
                f"(global rank {group.ranks[late]} is behind; same-host shared-memory transport). Check that every "
                f"rank of the group calls the same collectives in the same order (set PYPARALLEL_DEBUG=1 to "
                f"compare them)."
            )

    return stalled


def _shm_combine(op: str):
    return None if op in ("sum", "avg") else _COMBINE[op]


def all_gather(output: torch.Tensor, tensor: torch.Tensor, group: Group, async_op: bool = False):
    """Gather equal-sized ``tensor`` from every rank into ``output`` (size N x tensor, rank order)."""
    if output.numel() != tensor.numel() * group.size:
        raise ValueError(
            f"all_gather on group '{group.name}': output has {output.numel()} elements, expected "
            f"{group.size} x {tensor.numel()}"
        )
    _same_dtype("all_gather", group, output, tensor)

    def issue():
        arena = _arena_for(group, output) if tensor.is_contiguous() else None
        if arena is not None:
            arena.all_gather(output, tensor, _on_stall("all_gather", group))
            return None, None
        if _gloo_direct(group, output, _GLOO_GATHER_BYTES):
            return _gather_by_broadcasts(output, tensor, group), None
        work = _try_native(
            "all_gather_single",
            group,
            lambda: _all_gather_single()(output, tensor, group=group.pg, async_op=True),
        )
        if work is not None:
            return work, None
        parts = list(output.view(group.size, -1).unbind(0))
        return dist.all_gather(parts, tensor.reshape(-1), group=group.pg, async_op=True), None

    if group.size == 1:
        output.view(-1).copy_(tensor.reshape(-1))
    nbytes = output.numel() * output.element_size()
    return _run("all_gather", group, nbytes, issue, async_op, fp_tensor=tensor)


def all_gather_in_place(tensor: torch.Tensor, group: Group, async_op: bool = False):
    """All-gather whose input is this rank's own slice r of ``tensor`` (N equal slices): afterwards slice j
    holds rank j's. ZeRO's weights when the optimizer updated the slice in place. NCCL and gloo's broadcast
    path gather in place; gloo's own all-gather gets a copy of the slice (it must not alias the output)."""
    n = group.size
    if tensor.numel() % n:
        raise ValueError(f"all_gather_in_place on group '{group.name}': {tensor.numel()} elements do not split "
                         f"into {n} equal slices")
    flat = tensor.view(-1)
    mine = flat.view(n, -1)[group.rank]
    aliased_ok = (group.backend == "nccl" or n == 1 or _gloo_direct(group, flat, _GLOO_GATHER_BYTES)
                  or (group.pg is not None and _arena_for(group, flat) is not None))
    return all_gather(flat, mine if aliased_ok else mine.clone(), group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: Group, op: str = "sum", async_op=False):
    """Reduce ``tensor`` (N x output elements) over ``group``; rank r keeps slice r in ``output``."""
    if tensor.numel() != output.numel() * group.size:
        raise ValueError(
            f"reduce_scatter on group '{group.name}': input has {tensor.numel()} elements, expected "
            f"{group.size} x {output.numel()}"
        )
    _same_dtype("reduce_scatter", group, output, tensor)
    red = _op(op)

    def issue():
        arena = _arena_for(group, tensor, op) if output.is_contiguous() else None
        if arena is not None:
            arena.reduce_scatter(output, tensor.view(-1), _shm_combine(op), op == "avg",
                                 _on_stall("reduce_scatter", group))
            return None, None
        if _gloo_direct(group, tensor, _GLOO_EXCHANGE_BYTES):
            return _reduce_scatter_by_exchange(output, tensor.reshape(-1), group, op)

        def native(reduce_op):
            return lambda: _reduce_scatter_single()(output, tensor, op=reduce_op, group=group.pg, async_op=True)

        work = _try_native("reduce_scatter_" + op, group, native(red))
        if work is not None:
            return work, None
        if op == "avg":  # gloo without AVG: reduce-scatter a sum, then divide
            work = _try_native("reduce_scatter_sum", group, native(_op("sum")))
            if work is not None:
                return work, lambda: output.div_(group.size)
        # gloo without reduce-scatter: all-reduce a scratch copy and keep our slice.
        scratch = tensor.detach().clone()

        def keep_slice():
            mine = scratch.view(group.size, -1)[group.rank]
            output.view(-1).copy_(mine / group.size if op == "avg" else mine)

        work = dist.all_reduce(scratch, _op("sum") if op == "avg" else red, group=group.pg, async_op=True)
        return work, keep_slice

    if group.size == 1:
        output.view(-1).copy_(tensor.reshape(-1))
    nbytes = tensor.numel() * tensor.element_size()
    return _run("reduce_scatter", group, nbytes, issue, async_op, fp_tensor=tensor)


def reduce_scatter_in_place(tensor: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    """Reduce-scatter whose input the caller gives up: the reduced slice r is left in slice r of ``tensor``
    (N equal slices); the other slices are undefined afterwards. Accounted as a reduce-scatter.

    NCCL reduce-scatters in place. On gloo, inputs of 256 KiB and more are reduced by direct exchange
    (see ``_reduce_scatter_by_exchange``); smaller ones by an all-reduce of ``tensor`` itself, which skips
    the clone and copy of gloo's own reduce-scatter (ZeRO's gradient buckets are scratch once reduced)."""
    n = group.size
    if tensor.numel() % n:
        raise ValueError(f"reduce_scatter_in_place on group '{group.name}': {tensor.numel()} elements do not "
                         f"split into {n} equal slices")
    red = _op(op)
    flat = tensor.view(-1)
    mine = flat.view(n, -1)[group.rank]

    def issue():
        arena = _arena_for(group, flat, op)
        if arena is not None:
            arena.reduce_scatter(mine, flat, _shm_combine(op), op == "avg", _on_stall("reduce_scatter", group))
            return None, None
        if _gloo_direct(group, tensor, _GLOO_EXCHANGE_BYTES):
            return _reduce_scatter_by_exchange(mine, flat, group, op)
        if group.backend == "gloo":
            if op != "avg":
                return dist.all_reduce(flat, red, group=group.pg, async_op=True), None
            work = _try_native("avg", group, lambda: dist.all_reduce(flat, red, group=group.pg, async_op=True))
            if work is not None:
                return work, None
            return dist.all_reduce(flat, _op("sum"), group=group.pg, async_op=True), lambda: mine.div_(n)
        work = _try_native("reduce_scatter_" + op, group,
                           lambda: _reduce_scatter_single()(mine, flat, op=red, group=group.pg, async_op=True))
        if work is not None:
            return work, None
        work = _reduce_scatter_single()(mine, flat, op=_op("sum"), group=group.pg, async_op=True)
        return work, lambda: mine.div_(n)

    nbytes = tensor.numel() * tensor.element_size()
    return _run("reduce_scatter", group, nbytes, issue, async_op, fp_tensor=tensor)


def broadcast(tensor: torch.Tensor, src: int, group: Group, async_op: bool = False):
    """Broadcast ``tensor`` from group rank ``src`` (an index into ``group.ranks``) to the group."""
    if not 0 <= src < group.size:
        raise ValueError(f"broadcast on group '{group.name}': src {src} is not a rank of a group of {group.size}")

    def issue():
        arena = _arena_for(group, tensor)
        if arena is not None:
            arena.broadcast(tensor.view(-1), src, _on_stall("broadcast", group))
            return None, None
        return dist.broadcast(tensor, group.ranks[src], group=group.pg, async_op=True), None

    nbytes = tensor.numel() * tensor.element_size()
    return _run("broadcast", group, nbytes, issue, async_op, fp_tensor=tensor)


def _device_of(group: Group) -> torch.device:
    return torch.device("cpu") if group.backend == "gloo" else device.current_cuda_device()


def barrier(group: Group) -> None:
    """Block until every rank of ``group`` arrives (an all-reduce of one element, so it honours the
    group's timeout on every backend)."""
    token = torch.zeros(1, device=_device_of(group))
    _run("barrier", group, 0, lambda: (dist.all_reduce(token, group=group.pg, async_op=True), None), False)


def all_gather_object(obj, group: Group) -> list:
    """Gather a picklable object from every rank (for small metadata: fingerprints, shapes)."""
    _open("all_gather_object", group)
    group.seq += 1
    seq = group.seq
    out = [None] * group.size
    if group.size == 1:
        return [obj]
    try:
        dist.all_gather_object(out, obj, group=group.pg)
    except Exception as exc:
        raise _translate(exc, "all_gather_object", group, seq) from exc
    _account("all_gather_object", group, 0)
    return out


# -------------------------------------------------------------------------------- point to point (PP)


def send(tensor: torch.Tensor, dst: int, group: Group, async_op: bool = False):
    """Send to group rank ``dst``."""
    nbytes = tensor.numel() * tensor.element_size()
    return _p2p("send", group, nbytes, lambda: dist.isend(tensor, group.ranks[dst], group=group.pg), async_op,
                tensor)


def recv(tensor: torch.Tensor, src: int, group: Group, async_op: bool = False):
    """Receive from group rank ``src`` into ``tensor``."""
    nbytes = tensor.numel() * tensor.element_size()
    return _p2p("recv", group, nbytes, lambda: dist.irecv(tensor, group.ranks[src], group=group.pg), async_op,
                tensor)


def _channel_for(group: Group, tensor: torch.Tensor):
    """The two-rank group's shared-memory channel if its point-to-point messages take that path, else None.
    The first send or receive of the group on each rank opens it: two small collectives over the group, so
    that first call returns only once the peer has made its own first send or receive on the group (the
    pipeline exchanges a blocking ping on each link as soon as it creates it; every later send is
    asynchronous)."""
    if group.channel is False or group.size != 2 or tensor.device.type != "cpu":
        return None
    if group.channel is None:
        if not _shm_wanted(group):
            group.channel = False
            return None
        capacity = shm.slot_bytes()
        group.channel = _open_arena(group, lambda: shm.create_channel(capacity),
                                    lambda path: shm.Channel(path, group.rank, capacity))
    return group.channel or None


def _p2p_stall(op: str, group: Group):
    """What a point-to-point wait through shared memory does while the peer is behind (see _on_stall)."""
    seq, peer = group.seq, group.ranks[1 - group.rank]

    def stalled(_late: int, waited_s: float) -> None:
        where = _describe(op, group, seq)
        if liveness.gone(group):
            raise CollectiveError(f"pyparallel: {where} failed: lost a peer: {liveness.blame_peers(group)}")
        if waited_s >= group.timeout_s:
            what = ("the receiver did not take the earlier messages" if op == "send"
                    else "the sender never sent it")
            raise CollectiveTimeoutError(
                f"pyparallel: {where} did not complete within {group.timeout_s:g} s: {what} (global rank {peer} "
                f"is behind; same-host shared-memory transport). Check that both ranks exchange the same "
                f"messages in the same order.")

    return stalled


class _ChannelHandle(Handle):
    """A send or receive through a group's shared-memory channel (``shm.Channel``)."""

    def __init__(self, channel, msg, op: str, group: Group, seq: int, on_stall):
        super().__init__(None, op, group, seq)
        self._channel, self._msg, self._on_stall = channel, msg, on_stall

    def wait(self) -> None:
        if self._done:
            return
        if self._op == "recv":
            try:
                self._channel.complete(self._msg, self._on_stall)
            except shm.MessageMismatch as exc:
                peer = self._group.ranks[1 - self._group.rank]
                raise CollectiveMismatchError(
                    f"pyparallel: {_describe(self._op, self._group, self._seq)} failed: {exc} (global rank "
                    f"{peer}): the two ranks' messages differ in size or order") from None
        else:
            self._channel.wait_sent(self._msg)
        self._done = True

    def is_completed(self) -> bool:
        if self._done:
            return True
        return self._channel.arrived(self._msg) if self._op == "recv" else self._channel.sent(self._msg)


def _p2p(op: str, group: Group, nbytes: int, issue, async_op: bool, tensor: torch.Tensor | None = None):
    _open(op, group)
    channel = _channel_for(group, tensor) if tensor is not None else None
    group.seq += 1
    seq = group.seq
    _account(op, group, nbytes)
    if channel is not None:
        stall = _p2p_stall(op, group)
        msg = channel.recv(tensor) if op == "recv" else channel.send(tensor, stall)
        handle = _ChannelHandle(channel, msg, op, group, seq, stall)
        if not async_op:
            handle.wait()
            return None
        return handle
    try:
        work = issue()
    except Exception as exc:
        raise _translate(exc, op, group, seq) from exc
    if async_op and op == "recv" and group.backend == "gloo" and work is not None:
        if group.receive_waiter is None:
            group.receive_waiter = _ReceiveWaiter()
        handle = _WaitedHandle(work, op, group, seq)
        group.receive_waiter.submit(handle)
        return handle
    handle = Handle(work, op, group, seq)
    if async_op:
        return handle
    handle.wait()
    return None


# ------------------------------------------------------------------------------------------ debug mode


def _check_fingerprint(op: str, group: Group, seq: int, tensor: torch.Tensor | None) -> None:
    """All-gather every rank's fingerprint of this call (pyparallel/fingerprint.py); all fail alike on a mismatch."""
    n = fingerprint.LENGTH
    mine = torch.tensor(fingerprint.encode(op, seq, tensor), dtype=torch.int64, device=_device_of(group))
    gathered = torch.empty(group.size * n, dtype=torch.int64, device=mine.device)
    try:
        parts = list(gathered.view(group.size, n).unbind(0))
        dist.all_gather(parts, mine, group=group.pg)
    except Exception as exc:
        raise _translate(exc, f"{op} (debug fingerprint)", group, seq) from exc
    sides = fingerprint.disagreement(gathered.view(group.size, n).tolist(), group.ranks)
    if sides:
        raise CollectiveMismatchError(
            f"pyparallel: ranks of group '{group.name}' disagree on the next collective (detected on rank "
            f"{dist.get_rank()}): {sides}"
        )
