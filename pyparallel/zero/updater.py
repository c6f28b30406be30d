"""The optimizer step on a rank's own elements, on the device: :class:`DeviceUpdater`.

ZeRO (Rajbhandari et al. 2020, section 5.1): "each data parallel process only updates its partition". The
shard engine hands the update to an *updater*: this one on the device, or
``pyparallel.zero.offload.OptimizerOffload`` on the host (ZeRO-Offload, Ren et al. 2021). Both take the
master weights as *runs* (``pyparallel.zero.groups``: contiguous ranges of the rank's shard space, one
tensor of the inner optimizer each, in the param_group of its user group) and offer the same calls:
``push_grad(grad_shard)``, ``step(out_param_shard)``, ``wait()``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pyparallel.zero.reduce import shares_storage


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside ``obj`` (nested dicts/lists/tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class DeviceUpdater:
    """The inner optimizer on the device, over ``masters`` (one 1-D master tensor per run; views of the
    flat weights themselves when no separate master is kept) at shard-space ``ranges``.

    ``fuse=True`` runs exactly-torch Adam/AdamW through pyparallel's fused kernel when the device has one
    (``pyparallel.optim.cpu_adam.fused_step``, as OptimizerOffload does): one pass over master, gradient and
    moments that also writes the compute-dtype copy, instead of torch's seven. It reads and keeps the
    optimizer's own ``param_groups`` and ``state``; results agree with torch's at fp32 tolerance."""

    def __init__(self, masters: list[torch.Tensor], ranges: list[tuple[int, int]], optimizer_factory,
                 device: torch.device, fuse: bool = False):
        self.params = [nn.Parameter(m, requires_grad=True) for m in masters]  # share the masters' storage
        self.ranges = ranges
        self.optimizer = optimizer_factory(self.params)
        self.device = device
        self.fused = fuse and _can_fuse(self.optimizer, device)
        self._grad: torch.Tensor | None = None

    def push_grad(self, grad_shard: torch.Tensor) -> None:
        self._grad = grad_shard

    def _cut(self, shard: torch.Tensor) -> list[torch.Tensor]:
        return [shard[s:e] for s, e in self.ranges]

    def step(self, out_param_shard: torch.Tensor | None) -> None:
        """``out_param_shard`` None: the engine reads the masters directly."""
        separate = out_param_shard is not None and not any(shares_storage(out_param_shard, p) for p in self.params)
        grads = self._cut(self._grad)
        if self.fused:
            from pyparallel.optim.cpu_adam import fused_step

            lowp = separate and out_param_shard.dtype in (torch.bfloat16, torch.float16)
            # the runs' order, not param_groups' (the optimizer groups them by user group)
            fused_step(self.optimizer, grads=grads, lowp_out=self._cut(out_param_shard) if lowp else None,
                       params=self.params)
            separate = separate and not lowp
        else:
            for p, g in zip(self.params, grads):
                p.grad = g
            self.optimizer.step()
            for p in self.params:
                p.grad = None
        self._grad = None
        if separate:
            for p, out in zip(self.params, self._cut(out_param_shard)):
                out.copy_(p.detach())  # master dtype -> compute dtype

    def wait(self) -> None:
        return None

    def state_bytes(self) -> dict:
        return {"optimizer": tensor_bytes(list(self.optimizer.state.values()))}


def _can_fuse(optimizer, device: torch.device) -> bool:
    from pyparallel import _ops
    from pyparallel.optim.cpu_adam import can_fuse

    return can_fuse(optimizer) and _ops.has_kernel("adam_step", device)
