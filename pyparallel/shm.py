"""Collectives between the ranks of one host through shared memory: the transport under ``comm.py`` for gloo
groups whose ranks all run on this machine. Point-to-point messages of two-rank groups (the pipeline's
links) have a transport of their own at the end of this file (``Channel``).

Why: gloo moves every byte through loopback TCP (a copy into the kernel, a copy out, a thread hop on each
side), and each of its collectives pays that per message: on the development machine a 3.5 MB
reduce-scatter takes 2.4 ms over gloo where copying 3.5 MB takes 0.24 ms, and a one-element all-reduce
~0.15 ms. NCCL takes the same shortcut between GPUs of one node (its SHM / P2P transports), as do MPI
libraries and DeepSpeed's CPU backend for all-reduce. Here each rank owns one region of a shared mapping;
a collective is a few *rounds*: every rank copies its part into its own region, posts a counter, waits
for every peer's counter, reads what it needs from the peers' regions, and posts a second counter saying it
is done reading. Two sets of regions alternate, so a rank can write round k while a slow peer still reads
round k-1. Large tensors go in chunks of the region's size.

Results are the same on every rank (an all-reduce sums the regions in rank order everywhere) and do not
depend on arrival order. The counters live in the mapping too; ``csrc/cpu/shm_flags.cpp`` posts them behind
a fence and waits on them without the GIL. This module knows nothing about process groups: ``comm.py``
creates the mapping (one file under /dev/shm, unlinked as soon as every rank has mapped it, so a crash
leaves nothing behind), decides which collectives take this path, and turns a stall into an error that
names the op and the rank that is behind (``on_stall``).
"""

from __future__ import annotations

import collections
import mmap
import os
import tempfile
import threading
import time
import uuid

import torch

_LINE = 64  # bytes: each rank's counter on its own cache line
_ALIGN = 4096
_POLL_S = 0.5  # how often a wait comes back to Python to ask on_stall whether to give up
_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


# The whole mapping (two sets of n regions). Every page a rank touches counts in its resident set, so this
# is what the transport costs in memory; benchmarks/comm.py at 2 ranks: 1 MiB in all (256 KiB regions) made
# a 14 MB reduce-scatter 1.9x slower (per-round overhead), 4 MiB and more were within noise of each other.
_MAPPING_BYTES = 8 << 20


def region_bytes(n: int) -> int:
    """Bytes of one rank's region: an even share of the mapping, at least 256 KiB."""
    per = _MAPPING_BYTES // (2 * n)
    return max(256 << 10, per // _ALIGN * _ALIGN)


def touched_bytes(n: int, largest_message: float) -> int:
    """What the transport adds to a rank's resident set (the pages it touches: every region of both sets,
    as far as the largest message of the group fills them): the bench's memory prediction on CPUs."""
    per = min(region_bytes(n), -(-int(largest_message) // _ALIGN) * _ALIGN)
    return 2 * n * per


def _layout(n: int, capacity: int) -> tuple[int, int]:
    flags = 2 * n * _LINE
    head = (flags + _ALIGN - 1) // _ALIGN * _ALIGN
    return head, head + 2 * n * capacity


def create(n: int, capacity: int) -> str | None:
    """Create (and reserve: tmpfs pages are allocated up front, so a full /dev/shm fails here with ENOSPC,
    not later with SIGBUS) the file for an arena of ``n`` ranks. None when the host cannot give the space."""
    return _create(_layout(n, capacity)[1])


def _create(total: int) -> str | None:
    path = os.path.join(_DIR, f"pyparallel-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path


def _map(path: str, total: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Map the whole file (which must be ``total`` bytes): the mapping and a uint8 tensor over it."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != total:
            raise OSError(f"{path}: {os.fstat(fd).st_size} bytes, expected {total}")
        mapping = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def _wait(flags: torch.Tensor, value: int, on_stall) -> None:
    """Until every counter in ``flags`` is at least ``value``; every ``_POLL_S`` ``on_stall(late, waited_s)``
    may raise to give up (``late``: the row that is behind)."""
    start = time.monotonic()
    while True:
        late = torch.ops.pyparallel.shm_wait(flags, value, _POLL_S)
        if late < 0:
            return
        on_stall(late, time.monotonic() - start)


class Arena:
    """One rank's view of the shared mapping: its counters, the regions, the rounds done so far."""

    def __init__(self, path: str, n: int, rank: int, capacity: int):
        head, total = _layout(n, capacity)
        self._map, raw = _map(path, total)
        lines = raw[: 2 * n * _LINE].view(torch.int64).view(2, n, _LINE // 8)
        self._arrive, self._depart = lines[0], lines[1]
        self._data = raw[head:total].view(2, n, capacity)
        self.n, self.rank, self.capacity = n, rank, capacity
        self.rounds = 0

    # ------------------------------------------------------------------------------------------- rounds

    def _round(self, write, read, on_stall) -> None:
        """One exchange: ``write(region)`` fills this rank's region, ``read(regions)`` reads every rank's
        (a [n, capacity] uint8 tensor) once all have written."""
        k = self.rounds + 1
        regions = self._data[k % 2]
        if k > 2:  # every peer has finished reading what this set held two rounds ago
            _wait(self._depart, k - 2, on_stall)
        if write is not None:
            write(regions[self.rank])
        torch.ops.pyparallel.shm_post(self._arrive, self.rank, k)
        _wait(self._arrive, k, on_stall)
        read(regions)
        torch.ops.pyparallel.shm_post(self._depart, self.rank, k)
        self.rounds = k

    @staticmethod
    def _typed(region: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return region[: numel * dtype.itemsize].view(dtype)

    def _chunk(self, dtype: torch.dtype, parts: int) -> int:
        return max(1, self.capacity // (parts * dtype.itemsize))

    # -------------------------------------------------------------------------------------- collectives

    def all_reduce(self, flat: torch.Tensor, combine, divide: bool, on_stall) -> None:
        """In place over a contiguous 1-D ``flat``: every rank ends with the combination of all, in rank
        order (bitwise the same on every rank)."""
        step = self._chunk(flat.dtype, 1)
        for c0 in range(0, flat.numel(), step):
            piece = flat[c0: c0 + step]
            w = piece.numel()

            def read(regions, piece=piece, w=w):
                parts = [self._typed(regions[j], flat.dtype, w) for j in range(self.n)]
                _combine_into(piece, parts, combine)
                if divide:
                    piece.div_(self.n)

            self._round(lambda region, piece=piece, w=w: self._typed(region, flat.dtype, w).copy_(piece), read,
                        on_stall)

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, combine, divide: bool, on_stall) -> None:
        """``flat`` holds n equal slices; this rank's ``out`` (which may be its own slice of ``flat``) gets
        the combination of every rank's slice ``rank``."""
        n, m = self.n, out.numel()
        slices = flat.view(n, m)
        step = self._chunk(flat.dtype, n)
        for c0 in range(0, m, step):
            c1 = min(m, c0 + step)
            w = c1 - c0

            def write(region, c0=c0, c1=c1, w=w):
                self._typed(region, flat.dtype, n * w).view(n, w).copy_(slices[:, c0:c1])

            def read(regions, c0=c0, w=w):
                parts = [self._typed(regions[j], flat.dtype, n * w).view(n, w)[self.rank] for j in range(n)]
                piece = out.view(-1)[c0: c0 + w]
                _combine_into(piece, parts, combine)
                if divide:
                    piece.div_(n)

            self._round(write, read, on_stall)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, on_stall) -> None:
        """``output`` (n x tensor elements) gets every rank's ``tensor`` in rank order; ``tensor`` may be this
        rank's own slice of ``output``."""
        n, m = self.n, tensor.numel()
        slots, src = output.view(n, m), tensor.reshape(-1)
        aliased = src.data_ptr() == slots[self.rank].data_ptr()
        step = self._chunk(tensor.dtype, 1)
        for c0 in range(0, m, step):
            c1 = min(m, c0 + step)
            w = c1 - c0

            def read(regions, c0=c0, c1=c1, w=w):
                for j in range(n):
                    if j == self.rank and aliased:
                        continue
                    slots[j, c0:c1].copy_(self._typed(regions[j], tensor.dtype, w))

            self._round(lambda region, c0=c0, c1=c1, w=w: self._typed(region, tensor.dtype, w).copy_(src[c0:c1]),
                        read, on_stall)

    def broadcast(self, flat: torch.Tensor, src: int, on_stall) -> None:
        """In place over a contiguous 1-D ``flat``: every rank gets rank ``src``'s."""
        step = self._chunk(flat.dtype, 1)
        mine = self.rank == src
        for c0 in range(0, flat.numel(), step):
            piece = flat[c0: c0 + step]
            w = piece.numel()

            def write(region, piece=piece, w=w):
                self._typed(region, flat.dtype, w).copy_(piece)

            def read(regions, piece=piece, w=w):
                if not mine:
                    piece.copy_(self._typed(regions[src], flat.dtype, w))

            self._round(write if mine else None, read, on_stall)


def _combine_into(out: torch.Tensor, parts: list[torch.Tensor], combine) -> None:
    """out = parts[0] (op) parts[1] (op) ... in order; ``combine`` is None for a sum (one fused add for the
    first two) or an in-place binary op."""
    if combine is None and len(parts) >= 2:
        torch.add(parts[0], parts[1], out=out)
        rest = parts[2:]
        for p in rest:
            out.add_(p)
        return
    out.copy_(parts[0])
    for p in parts[1:]:
        (combine or torch.Tensor.add_)(out, p)


# ------------------------------------------------------------------------------------- point to point
# The pipeline's messages (activations forward, gradients backward) between two ranks of one host. Over gloo
# each is a TCP transfer that gloo's I/O thread on the receiving side must be scheduled to read, on cores the
# stages keep busy computing; through the mapping it is one copy in by the sender and one copy out by the
# receiver when it takes the message, on their own threads.

SLOTS = 4  # per direction
_CHANNEL_BYTES = 8 << 20  # the whole mapping of one two-rank group: both directions' slots


def slot_bytes() -> int:
    return _CHANNEL_BYTES // (2 * SLOTS)


def create_channel(capacity: int) -> str | None:
    """The file of a two-rank channel with slots of ``capacity`` bytes (reserved up front, as ``create``)."""
    return _create(_ALIGN + 2 * SLOTS * (_LINE + capacity))


class MessageMismatch(ValueError):
    """The receive's buffer does not have the size of the message the peer sent in its place."""


class Message:
    """One send or receive: its bytes, the channel-wide numbers ``[first, end)`` of its chunks, the next
    chunk to move, and (a send left to the writer thread) the event set once it is all written."""

    __slots__ = ("data", "first", "next", "end", "target", "error", "written")

    def __init__(self, data: torch.Tensor, first: int, chunks: int, target: torch.Tensor | None = None):
        self.data, self.first, self.next, self.end, self.target = data, first, first, first + chunks, target
        self.error: BaseException | None = None
        self.written: threading.Event | None = None

    @property
    def done(self) -> bool:
        return self.next >= self.end


class Channel:
    """Messages between the two ranks of a group through one ring of ``SLOTS`` slots per direction, matched
    first in, first out (as gloo's are). Chunk j of a direction goes through slot j % SLOTS: its sender
    copies it in once the receiver has freed the slot (``freed >= j + 1 - SLOTS``) and posts ``sent = j + 1``;
    the receiver, when it takes the message, waits for that, copies the chunk out and posts ``freed = j + 1``.

    A send never blocks (the pipeline's freedom from deadlock rests on that: pipeline_parallel/p2p.py): what
    the ring cannot hold now is written by a helper thread, in order, as the receiver frees slots; that
    thread waits without the GIL and gives up at the group's timeout. A receive's data is copied out when it
    is waited for (earlier receives first); ``arrived`` says without blocking whether it is all there."""

    def __init__(self, path: str, rank: int, capacity: int):
        total = _ALIGN + 2 * SLOTS * (_LINE + capacity)
        self._map, raw = _map(path, total)
        # [direction (the sender's rank)][sent, freed]: each a one-row counter table on its own cache line.
        lines = raw[: 4 * _LINE].view(torch.int64).view(2, 2, 1, _LINE // 8)
        self._sent, self._freed = [lines[d, 0] for d in range(2)], [lines[d, 1] for d in range(2)]
        # Each slot: a header line (the message's bytes, the chunk's index in it), then the chunk.
        slots = raw[_ALIGN:total].view(2, SLOTS, _LINE + capacity)
        self._heads = slots[:, :, :_LINE].view(torch.int64)
        self._slots = slots[:, :, _LINE:]
        self.rank, self.capacity = rank, capacity
        self._out, self._in = rank, 1 - rank
        self._issued = 0  # chunks of the sends issued so far, written or not
        self._queue: collections.deque[Message] = collections.deque()  # sends not yet all written, in order
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._broken: BaseException | None = None
        self._expected = 0  # chunks of the receives posted so far
        self._receives: collections.deque[Message] = collections.deque()  # posted, not yet copied out
        self._out_of_step: MessageMismatch | None = None

    def _chunks(self, nbytes: int) -> int:
        return -(-nbytes // self.capacity)

    @staticmethod
    def _ready(flags: torch.Tensor, value: int) -> bool:
        # An acquire load through the extension (no spinning when it is there already).
        return torch.ops.pyparallel.shm_wait(flags, value, 0.0) < 0

    # --------------------------------------------------------------------------------------------- send

    def send(self, tensor: torch.Tensor, on_stall) -> Message:
        """Issue a send of ``tensor`` (which must stay unchanged until the message is written)."""
        if self._broken is not None:
            raise self._broken
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        msg = Message(data, self._issued, self._chunks(data.numel()))
        self._issued = msg.end
        with self._lock:
            self._queue.append(msg)
            self._write_ready()
            if self._queue and self._writer is None:
                msg.written = threading.Event()
                self._writer = threading.Thread(target=self._write_rest, args=(on_stall,), daemon=True,
                                                name="pyparallel-shm-send")
                self._writer.start()
            elif not msg.done:
                msg.written = threading.Event()
        return msg

    def _write_ready(self) -> None:
        """Under the lock: write queued chunks in order while the ring has free slots; never waits."""
        cap = self.capacity
        while self._queue:
            msg = self._queue[0]
            while msg.next < msg.end:
                j = msg.next
                if not self._ready(self._freed[self._out], j + 1 - SLOTS):
                    return
                lo = (j - msg.first) * cap
                piece = msg.data[lo: lo + cap]
                self._slots[self._out, j % SLOTS, : piece.numel()].copy_(piece)
                self._heads[self._out, j % SLOTS, :2] = torch.tensor([msg.data.numel(), j - msg.first])
                torch.ops.pyparallel.shm_post(self._sent[self._out], 0, j + 1)
                msg.next = j + 1
            self._queue.popleft()
            if msg.written is not None:
                msg.written.set()

    def _write_rest(self, on_stall) -> None:
        try:
            while True:
                with self._lock:
                    self._write_ready()
                    if not self._queue:
                        self._writer = None
                        return
                    need = self._queue[0].next + 1 - SLOTS
                _wait(self._freed[self._out], need, on_stall)
        except BaseException as exc:  # noqa: BLE001 -- handed to whoever waits for these sends
            with self._lock:
                self._broken = exc
                for msg in self._queue:
                    msg.error = exc
                    if msg.written is not None:
                        msg.written.set()
                self._queue.clear()
                self._writer = None

    @staticmethod
    def sent(msg: Message) -> bool:
        return msg.done or msg.error is not None

    @staticmethod
    def wait_sent(msg: Message) -> None:
        if msg.written is not None:
            msg.written.wait()  # bounded: the writer gives up at the group's timeout
        if msg.error is not None:
            raise msg.error

    # ------------------------------------------------------------------------------------------ receive

    def recv(self, tensor: torch.Tensor) -> Message:
        """Post a receive into ``tensor``; the data lands there when ``complete`` is called for it."""
        buf = tensor if tensor.is_contiguous() else torch.empty(tensor.shape, dtype=tensor.dtype)
        data = buf.reshape(-1).view(torch.uint8)
        msg = Message(data, self._expected, self._chunks(data.numel()), tensor if buf is not tensor else None)
        self._expected = msg.end
        self._receives.append(msg)
        return msg

    def arrived(self, msg: Message) -> bool:
        """Whether all of ``msg``'s chunks are there (or copied out already), without blocking."""
        return msg.done or (msg.end - self._read_upto() <= SLOTS and self._ready(self._sent[self._in], msg.end))

    def _read_upto(self) -> int:
        return self._receives[0].next if self._receives else self._expected

    def complete(self, msg: Message, on_stall) -> None:
        """Copy out every posted receive up to and including ``msg``, in order, waiting for their chunks."""
        cap = self.capacity
        while not msg.done:
            if self._out_of_step is not None:
                raise self._out_of_step
            head = self._receives[0]
            while head.next < head.end:
                j = head.next
                _wait(self._sent[self._in], j + 1, on_stall)
                nbytes, index = self._heads[self._in, j % SLOTS, :2].tolist()
                if (nbytes, index) != (head.data.numel(), j - head.first):
                    # The stream is out of step: no later receive can be trusted either.
                    self._out_of_step = MessageMismatch(f"a receive of {head.data.numel()} bytes met a message "
                                                        f"of {nbytes} bytes (chunk {index}) from the peer")
                    raise self._out_of_step
                lo = (j - head.first) * cap
                piece = head.data[lo: lo + cap]
                piece.copy_(self._slots[self._in, j % SLOTS, : piece.numel()])
                torch.ops.pyparallel.shm_post(self._freed[self._in], 0, j + 1)
                head.next = j + 1
            if head.target is not None:
                head.target.copy_(head.data.view(head.target.dtype).view(head.target.shape))
            self._receives.popleft()
