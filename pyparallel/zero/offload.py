"""ZeRO-Offload's host side: the fp32 master shard and the optimizer state live in (pinned) host memory.

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", section 4)
keeps parameters and gradients of the compute dtype on the accelerator and moves the fp32 master weights
and Adam's moments (12 of the 16 bytes per parameter) to the host. Per step each rank streams its gradient
shard to the host while backward continues, runs the CPU Adam on the host (``pyparallel.optim.CPUAdam``:
SIMD, all threads, writing the bf16/fp16 weights in the same pass) and copies the updated shard back.

ZeRO calls::

    off = OptimizerOffload(master_shard, optimizer_factory, device)
    off.push_grad(grad_shard)       # async device -> host, as soon as the shard is reduced
    off.step(out_param_shard)       # host optimizer step, then async host -> device into out_param_shard
    off.wait()                      # the copy back has landed

The copies go through ``pyparallel._C.OffloadCopyEngine`` (csrc/offload): a side CUDA stream with events
on GPUs, a worker thread on CPU-only machines: the same Python path either way. The tensors given to
``push_grad`` and ``step`` must not be modified until ``step`` (for the gradient) or ``wait`` (for the
output) returns.

``delayed_update=True`` is the paper's one-step delayed parameter update (DPU, section 5.2): the host step
of iteration t runs in the background, overlapping the forward and backward of iteration t+1, which
therefore use the weights of iteration t-1. It changes the numerics (gradients are one step stale) and is
off by default; the paper enables it after a warm-up (``delayed_update_after`` steps).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn as nn

from pyparallel import _ops
from pyparallel import device as device_mod
from pyparallel.optim.cpu_adam import can_fuse, fused_step

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gib(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 match (an index left out means the current device)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (no check)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _SyncEngine:
    """The copy engine's API in plain torch, for installs without the extension: synchronous copies."""

    def __init__(self, device: torch.device, pin: bool):
        self.pinned, self.uses_cuda, self.device, self.allocated_bytes = pin, False, device, 0

    def alloc(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        try:
            t = torch.empty(numel, dtype=dtype, pin_memory=self.pinned)
        except RuntimeError as exc:
            raise MemoryError(f"pyparallel offload: could not allocate {_gib(nbytes)} of host memory for "
                              f"{what}: {exc}") from None
        self.allocated_bytes += nbytes
        return t

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        dst.copy_(src)
        return 0

    def wait(self, ticket: int) -> None:
        return None

    wait_on_current_stream = wait


def _make_engine(device: torch.device, pin: bool):
    ext = _ops._C if _ops.HAS_EXT else None
    if ext is not None and hasattr(ext, "OffloadCopyEngine") and (device.type != "cuda" or ext.with_cuda):
        return ext.OffloadCopyEngine(device, pin)
    return _SyncEngine(device, pin)  # no extension, or one built without CUDA on a GPU machine


class OptimizerOffload:
    """Host-resident fp32 master shard + optimizer, fed by async gradient copies (see the module doc).

    Args:
        master_shard: this rank's flat fp32 master shard (1-D, on the compute device); copied to the host.
        optimizer_factory: builds the optimizer from the list of master parameters, one per range (views of
            the host master). When it builds torch.optim.Adam or
            AdamW (or a pyparallel FusedAdam/CPUAdam), its update runs in the fused CPU kernel on its own
            ``param_groups`` and ``state`` (LR schedules and state dicts keep working).
        device: the compute device (where gradient and output shards live).
        cpu_adam: False runs the factory's optimizer as it is (its own ``step``).
        pin_memory: page-locked host buffers; default: when ``device`` is a CUDA device.
        delayed_update / delayed_update_after: the one-step delayed parameter update (changes numerics).
        ranges: ``(start, end)`` of each optimizer tensor in the shard (default: one, the whole shard).
    """

    def __init__(self, master_shard: torch.Tensor, optimizer_factory: Callable[[list[nn.Parameter]],
                 torch.optim.Optimizer], device: torch.device, *, cpu_adam: bool = True,
                 pin_memory: bool | None = None, delayed_update: bool = False, delayed_update_after: int = 0,
                 ranges: list[tuple[int, int]] | None = None):
        if not isinstance(master_shard, torch.Tensor) or master_shard.dtype != torch.float32 or \
                master_shard.dim() != 1:
            raise ValueError(f"OptimizerOffload: master_shard must be a 1-D fp32 tensor, got "
                             f"{getattr(master_shard, 'dtype', type(master_shard))} of shape "
                             f"{tuple(getattr(master_shard, 'shape', ()))}")
        if delayed_update_after < 0:
            raise ValueError(f"OptimizerOffload: delayed_update_after must be >= 0, got {delayed_update_after}")
        self.device = torch.device(device)
        self.numel = n = master_shard.numel()
        pin = (self.device.type == "cuda" and device_mod.pin_memory_available()) if pin_memory is None else pin_memory
        self._check_host_memory(n)
        self._engine = _make_engine(self.device, bool(pin))
        self._master = self._engine.alloc(n, torch.float32, "the fp32 master shard")
        self._engine.wait(self._engine.copy(self._master, master_shard.detach()))
        # One optimizer tensor per run of the shard (``pyparallel.zero.groups``), each a view of the host buffer.
        self.ranges = list(ranges) if ranges is not None else [(0, n)]
        self.params = [nn.Parameter(self._master[s:e], requires_grad=True) for s, e in self.ranges]
        self.optimizer = optimizer_factory(self.params)
        self.fused = cpu_adam and can_fuse(self.optimizer)
        self._grads: list[torch.Tensor | None] = [None, None]  # two slots: DPU reads one while the other fills
        self._grad_ticket, self._pushed, self._slot = [0, 0], [0, 0], 0
        self._lowp: torch.Tensor | None = None  # bf16/fp16 host copy of the updated master
        self._grad32: torch.Tensor | None = None  # fp32 grads for a non-fused optimizer
        self._copy_ticket = 0
        self.delayed_update, self.delayed_update_after = delayed_update, delayed_update_after
        self._bg: threading.Thread | None = None
        self._bg_error: BaseException | None = None
        self.steps = 0

    @staticmethod
    def _check_host_memory(n: int) -> None:
        need = 16 * n  # fp32 master 4 + Adam moments 8 + an fp32 gradient buffer 4 bytes per element
        avail = _host_memory_available()
        if avail is not None and need > avail:
            raise MemoryError(f"OptimizerOffload: a shard of {n} elements needs about {_gib(need)} of host memory "
                              f"(fp32 master, Adam moments, gradient buffer) but only {_gib(avail)} is available; "
                              "use more data-parallel ranks or a smaller model")

    # ------------------------------------------------------------------ the four calls ZeRO makes

    @property
    def master(self) -> torch.Tensor:
        """The host fp32 master shard (after the last update: waits for a delayed one)."""
        self._join_background()
        return self._master

    def push_grad(self, grad_shard: torch.Tensor, offset: int = 0) -> None:
        """Starts the async copy of ``grad_shard`` (fp32/bf16/fp16) into the host gradient buffer at
        ``offset``; several calls may fill one step's shard piecewise."""
        g = grad_shard.detach()
        if not g.is_contiguous() or g.dtype not in _OUT_DTYPES:
            raise ValueError(f"push_grad: the gradient shard must be a contiguous fp32/bf16/fp16 tensor, got "
                             f"{g.dtype} with strides {g.stride()}")
        if not _same_device(g.device, self.device) and g.device.type != "cpu":
            raise ValueError(f"push_grad: gradient on {g.device}, but this offload serves {self.device}")
        if offset < 0 or offset + g.numel() > self.numel:
            raise ValueError(f"push_grad: {g.numel()} elements at offset {offset} overflow the shard of "
                             f"{self.numel}")
        slot = self._slot
        buf = self._grad_buffer(slot, g.dtype)
        self._grad_ticket[slot] = self._engine.copy(buf.narrow(0, offset, g.numel()), g.view(-1))
        self._pushed[slot] += g.numel()

    def step(self, out_param_shard: torch.Tensor) -> None:
        """Waits for the gradients, runs the optimizer on the host master and starts the async copy of the
        updated weights, cast to ``out_param_shard.dtype``, into ``out_param_shard``."""
        out = self._check_out(out_param_shard)
        slot = self._slot
        if self._pushed[slot] < self.numel:
            raise ValueError(f"step: push_grad delivered {self._pushed[slot]} of the shard's {self.numel} "
                             "gradient elements this step")
        self._engine.wait(self._grad_ticket[slot])
        if self.delayed_update and self.steps >= self.delayed_update_after:
            self._step_delayed(out, slot)
        else:
            self._join_background()
            self._engine.wait(self._copy_ticket)  # the previous copy back may still read master / lowp
            self._update(slot, out.dtype)
            self._copy_ticket = self._engine.copy(out, self._source(out.dtype))
        self._pushed[slot] = 0
        self.steps += 1

    def wait(self, blocking: bool = True) -> None:
        """Waits until the weights of the last ``step`` are in ``out_param_shard``. ``blocking=False`` only
        makes the device's current stream wait (CUDA), leaving the host free."""
        if blocking:
            self._engine.wait(self._copy_ticket)
        else:
            self._engine.wait_on_current_stream(self._copy_ticket)

    def state_bytes(self) -> dict:
        """Host bytes: ``master``, ``optimizer`` (state tensors), ``buffers`` (gradient and bf16/fp16
        staging), ``total``."""
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

        opt = sum(nbytes(s.values()) for s in self.optimizer.state.values())
        buffers = nbytes([*self._grads, self._lowp, self._grad32])
        master = self.numel * 4
        return {"master": master, "optimizer": opt, "buffers": buffers, "total": master + opt + buffers}

    # ------------------------------------------------------------------ extras

    @property
    def pinned(self) -> bool:
        return bool(self._engine.pinned)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def flush(self, out_param_shard: torch.Tensor | None = None) -> None:
        """Finishes a delayed update and, given ``out_param_shard``, copies the latest weights into it
        (with delayed_update the device is one update behind until then)."""
        self._join_background()
        if out_param_shard is not None:
            out = self._check_out(out_param_shard)
            self._engine.wait(self._copy_ticket)
            self._copy_ticket = self._engine.copy(out, self._source(out.dtype))
        self.wait()

    def state_dict(self) -> dict:
        return {"master": self.master.clone(), "optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self._join_background()
        self._engine.wait(self._copy_ticket)
        self._master.copy_(state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("steps", self.steps))

    # ------------------------------------------------------------------ internals

    def _check_out(self, out: torch.Tensor) -> torch.Tensor:
        o = out.detach()
        if o.numel() != self.numel or not o.is_contiguous() or o.dtype not in _OUT_DTYPES:
            raise ValueError(f"step: out_param_shard must be a contiguous fp32/bf16/fp16 tensor of {self.numel} "
                             f"elements, got {o.dtype} of {o.numel()}")
        return o.view(-1)

    def _grad_buffer(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._grads[slot]
        if buf is None or buf.dtype != dtype:
            if self._pushed[slot]:
                raise ValueError(f"push_grad: gradient pieces of one step must share a dtype ({buf.dtype} then "
                                 f"{dtype})")
            self._engine.wait(self._grad_ticket[slot])
            buf = self._grads[slot] = self._engine.alloc(self.numel, dtype, f"the {dtype} gradient shard")
        return buf

    def _lowp_buffer(self, dtype: torch.dtype) -> torch.Tensor | None:
        if dtype == torch.float32:
            return None
        if self._lowp is None or self._lowp.dtype != dtype:
            self._lowp = self._engine.alloc(self.numel, dtype, f"the {dtype} copy of the updated weights")
            self._lowp.copy_(self._master)  # a delayed first step ships it before any update wrote it
        return self._lowp

    def _cut(self, shard: torch.Tensor) -> list[torch.Tensor]:
        return [shard[s:e] for s, e in self.ranges]

    def _source(self, dtype: torch.dtype) -> torch.Tensor:
        return self._master if dtype == torch.float32 else self._lowp

    def _update(self, slot: int, out_dtype: torch.dtype) -> None:
        """The host optimizer step on gradient slot ``slot``; fills the bf16/fp16 copy when one is sent."""
        grad = self._grads[slot]
        lowp = self._lowp_buffer(out_dtype)
        if self.fused:  # one pass: moments, master and the low-precision copy together
            # paired with the runs' order, not param_groups' (the optimizer groups them by user group)
            fused_step(self.optimizer, grads=self._cut(grad), lowp_out=None if lowp is None else self._cut(lowp),
                       params=self.params)
            return
        if grad.dtype != torch.float32:
            if self._grad32 is None:
                self._grad32 = self._engine.alloc(self.numel, torch.float32, "an fp32 gradient shard")
            grad = self._grad32.copy_(grad)
        for p, g in zip(self.params, self._cut(grad)):
            p.grad = g
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        if lowp is not None:
            lowp.copy_(self._master)

    def _step_delayed(self, out: torch.Tensor, slot: int) -> None:
        """DPU: ship the weights of the previous update now, compute this step's update in the background."""
        self._join_background()
        self._lowp_buffer(out.dtype)  # allocate here, not on the background thread
        ticket = self._copy_ticket = self._engine.copy(out, self._source(out.dtype))
        self._bg = threading.Thread(target=self._background_update, args=(slot, out.dtype, ticket),
                                    name="pyparallel-offload-dpu", daemon=True)
        self._slot ^= 1  # the next push_grad fills the other buffer while this one is read
        self._bg.start()

    def _background_update(self, slot: int, out_dtype: torch.dtype, ticket: int) -> None:
        try:
            self._engine.wait(ticket)  # the copy back reads master / lowp: let it finish first
            self._update(slot, out_dtype)
        except BaseException as exc:  # reported by the next join, on the caller's thread
            self._bg_error = exc

    def _join_background(self) -> None:
        if self._bg is None:
            return
        self._bg.join()
        self._bg = None
        if self._bg_error is not None:
            err, self._bg_error = self._bg_error, None
            raise RuntimeError("OptimizerOffload: the delayed optimizer step failed") from err
