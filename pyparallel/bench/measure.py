"""What the bench measures on a rank: peak memory of a training run, model-state bytes, step times.

Peak memory on a GPU is the caching allocator's peak (``pyparallel.device``). On a CPU there is no
allocator to ask, so the bench reads the kernel's own high-water mark of the resident set (``VmHWM`` in
``/proc/self/status``), which it resets before the measured steps by writing ``5`` to
``/proc/self/clear_refs``. Two things make that figure track tensors: in *precise* mode glibc serves
every allocation of 64 KiB or more with its own mmap (``mallopt(M_MMAP_THRESHOLD)``), so a freed tensor
goes back to the kernel at once instead of staying in a heap arena, and the heap is trimmed
(``malloc_trim``) before each baseline is read. The figure reported is the growth of the process over
the resident set it had before the strategy's model was built.

Precise mode costs page faults on every large allocation (a quarter of a small model's step time), so
the timed steps run in *fast* mode: allocations up to 32 MiB come from the heap and freed memory is kept
for reuse, as glibc settles into by itself in a long training run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time

import torch

from pyparallel import device as _device

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim  # noqa: B018 (probe: musl and macOS lack it)
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def precise_mode() -> None:
    """Large allocations become their own mmaps: resident memory follows live tensors (module doc)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)


def fast_mode() -> None:
    """The heap serves and keeps allocations up to 32 MiB (glibc's dynamic ceiling): no page faults per
    step once warm. Resident memory then no longer follows live tensors."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)




def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def settle() -> None:
    """Free what Python holds and hand freed heap back to the kernel."""
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class PeakMemory:
    """``baseline()`` before building a strategy, ``start()`` after building it, ``peak_bytes()`` after
    the steps: the growth of the rank's memory over the baseline at its highest during the steps."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.base = 0
        self.ok = True

    def _current(self) -> int | None:
        if self.dev.type == "cuda":
            return _device.memory_allocated(self.dev)
        kib = _status_kib("VmRSS")
        return None if kib is None else kib * 1024

    def baseline(self) -> None:
        settle()
        self.base = self._current() or 0

    def start(self) -> None:
        settle()
        if self.dev.type == "cuda":
            _device.reset_peak_memory(self.dev)
        else:
            self.ok = _reset_hwm() and _status_kib("VmHWM") is not None

    def peak_bytes(self) -> int | None:
        if self.dev.type == "cuda":
            peak = _device.peak_memory_bytes(self.dev)
        else:
            kib = _status_kib("VmHWM") if self.ok else None
            peak = None if kib is None else kib * 1024
        return None if peak is None else max(0, peak - self.base)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2, DTensor TP); a plain tensor as is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _storage_bytes(tensors, seen: set) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views into one flat buffer count once)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def count_model_states(params, optimizers) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state tensors, counted by storage.

    The fallback when a strategy offers no accounting of its own: it sees what the module and the
    optimizer hold (for a wrapper, pass the flat shards it keeps). A freed (zero-size) storage counts 0.
    """
    params = list(params)
    seen: set = set()
    out = {"params": _storage_bytes(params, seen), "grads": _storage_bytes((p.grad for p in params), seen)}
    opt_tensors = []
    for opt in optimizers:
        for st in opt.state.values():
            opt_tensors += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out["optimizer"] = _storage_bytes(opt_tensors, seen)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


class StepTimer:
    """Wall time of one step, with queued device work drained at both ends."""

    def __init__(self, dev: torch.device):
        self.dev = dev

    def __enter__(self):
        _device.synchronize(self.dev)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _device.synchronize(self.dev)
        self.seconds = time.perf_counter() - self.t0
        return False
