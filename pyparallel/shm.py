"""Collectives between the ranks of one host through shared memory: the transport under ``comm.py`` for gloo
groups whose ranks all run on this machine.

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

import mmap
import os
import tempfile
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
    path = os.path.join(_DIR, f"pyparallel-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    _, total = _layout(n, capacity)
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


class Arena:
    """One rank's view of the shared mapping: its counters, the regions, the rounds done so far."""

    def __init__(self, path: str, n: int, rank: int, capacity: int):
        head, total = _layout(n, capacity)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != total:
                raise OSError(f"{path}: {os.fstat(fd).st_size} bytes, expected {total}")
            self._map = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        lines = raw[: 2 * n * _LINE].view(torch.int64).view(2, n, _LINE // 8)
        self._arrive, self._depart = lines[0], lines[1]
        self._data = raw[head:total].view(2, n, capacity)
        self.n, self.rank, self.capacity = n, rank, capacity
        self.rounds = 0

    # ------------------------------------------------------------------------------------------- rounds

    def _wait(self, flags: torch.Tensor, value: int, on_stall) -> None:
        start = time.monotonic()
        while True:
            late = torch.ops.pyparallel.shm_wait(flags, value, _POLL_S)
            if late < 0:
                return
            on_stall(late, time.monotonic() - start)  # raises to give up

    def _round(self, write, read, on_stall) -> None:
        """One exchange: ``write(region)`` fills this rank's region, ``read(regions)`` reads every rank's
        (a [n, capacity] uint8 tensor) once all have written."""
        k = self.rounds + 1
        regions = self._data[k % 2]
        if k > 2:  # every peer has finished reading what this set held two rounds ago
            self._wait(self._depart, k - 2, on_stall)
        if write is not None:
            write(regions[self.rank])
        torch.ops.pyparallel.shm_post(self._arrive, self.rank, k)
        self._wait(self._arrive, k, on_stall)
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
