"""The per-rank shard update every ZeRO stage shares: loss-scale check, global-norm clipping, the optimizer
step on this rank's fp32 master shard, and handing the new weights back to the stage.

ZeRO (Rajbhandari et al. 2020, section 5.1): "each data parallel process only updates its partition".
One code path runs the update whether the optimizer lives on the device (:class:`DeviceUpdater`) or on the
host (``pyparallel.zero.offload.OptimizerOffload``, ZeRO-Offload, Ren et al. 2021); both offer the same four
calls: ``push_grad(grad_shard)``, ``step(out_param_shard)``, ``wait()`` and ``.master``.

Clipping uses the global norm over all shards: each rank sums the squares of its gradient shard (padding
slots are zero and add nothing), one all-reduce adds them up, and every rank scales its shard by the same
``max_norm / (norm + 1e-6)`` (clamped to 1) as ``torch.nn.utils.clip_grad_norm_`` would on the whole model.
The same all-reduce carries the fp16 overflow flag, so every rank skips (or takes) the same steps.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pyparallel import comm
from pyparallel.amp import DynamicLossScaler
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
    """The optimizer on the device, over one flat fp32 master shard, with OptimizerOffload's interface.

    ``fuse=True`` runs exactly-torch Adam/AdamW through pyparallel's fused kernel when the device has one
    (``pyparallel.optim.cpu_adam.fused_step``, as OptimizerOffload does): one pass over master, gradient and
    moments that also writes the compute-dtype copy, instead of torch's seven. It reads and keeps the
    optimizer's own ``param_groups`` and ``state``; results agree with torch's at fp32 tolerance."""

    def __init__(self, master_shard: torch.Tensor, optimizer_factory, device: torch.device, fuse: bool = False):
        self.param = nn.Parameter(master_shard, requires_grad=True)  # shares master_shard's storage
        self.optimizer = optimizer_factory([self.param])
        self.device = device
        self.fused = fuse and _can_fuse(self.optimizer, device)
        self._grad: torch.Tensor | None = None

    @property
    def master(self) -> torch.Tensor:
        return self.param.detach()

    def push_grad(self, grad_shard: torch.Tensor) -> None:
        self._grad = grad_shard

    def step(self, out_param_shard: torch.Tensor | None) -> None:
        """``out_param_shard`` None: the stage reads the master directly (stage 3 under mixed precision)."""
        separate = out_param_shard is not None and not shares_storage(out_param_shard, self.param)
        if self.fused:
            from pyparallel.optim.cpu_adam import fused_step

            lowp = separate and out_param_shard.dtype in (torch.bfloat16, torch.float16)
            fused_step(self.optimizer, grads=[self._grad], lowp_out=[out_param_shard] if lowp else None)
            separate = separate and not lowp
        else:
            self.param.grad = self._grad
            self.optimizer.step()
            self.param.grad = None
        self._grad = None
        if separate:
            out_param_shard.copy_(self.param.detach())  # fp32 -> compute dtype

    def wait(self) -> None:
        return None

    def state_bytes(self) -> dict:
        return {"optimizer": tensor_bytes(list(self.optimizer.state.values()))}


def _can_fuse(optimizer, device: torch.device) -> bool:
    from pyparallel import _ops
    from pyparallel.optim.cpu_adam import can_fuse

    return can_fuse(optimizer) and _ops.has_kernel("adam_step", device)


class ZeroOptimizer(torch.optim.Optimizer):
    """What ``pyparallel.zero.setup`` returns as the optimizer: ``step()`` updates this rank's shard and
    gives every rank the new weights; ``zero_grad()`` clears the gradient shards (and stage 1's full
    gradients). ``param_groups`` are the inner optimizer's, so LR schedulers work unchanged; ``state`` and
    ``state_dict()`` hold this rank's shard only.

    After a step: ``last_grad_norm`` (the global norm before clipping, when ``clip_grad_norm`` is set) and
    ``scaler`` (fp16 only: ``scaler.scale``, ``scaler.skipped_steps``).
    """

    def __init__(self, engine, updater, inner: torch.optim.Optimizer, clip_grad_norm: float | None,
                 scaler: DynamicLossScaler | None):
        self.engine = engine
        self.updater = updater
        self.inner = inner
        self.clip_grad_norm = clip_grad_norm
        self.scaler = scaler
        self.last_grad_norm: float | None = None
        super().__init__([p for g in inner.param_groups for p in g["params"]], dict(inner.defaults))
        self.param_groups = inner.param_groups
        self.state = inner.state
        self._built = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise ValueError("ZeRO's optimizer owns one flat parameter group over this rank's shard; parameters "
                             "cannot be added after setup (wrap the whole model in pyparallel.zero.setup)")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        eng = self.engine
        eng.finish_reductions()
        grad = eng.step_grad()  # fp32, this rank's shard space
        found_inf, total_norm = self._global_checks(grad)
        if found_inf:
            self.scaler.update(True)
            eng.zero_grad()
            return loss
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        coef = torch.tensor(inv_scale, dtype=torch.float32)
        if total_norm is not None:
            norm = total_norm * inv_scale
            self.last_grad_norm = float(norm)
            coef = coef * torch.clamp(self.clip_grad_norm / (norm + 1e-6), max=1.0)
        if float(coef) != 1.0:
            grad.mul_(coef.to(grad.device))
        out = eng.param_out()
        self.updater.push_grad(grad)
        self.updater.step(out)
        self.updater.wait()
        eng.publish(out)
        if self.scaler is not None:
            self.scaler.update(False)
        return loss

    def _global_checks(self, grad: torch.Tensor):
        """One all-reduce of (overflow flag, squared norm) when either is needed."""
        if self.scaler is None and self.clip_grad_norm is None:
            return False, None
        stats = torch.zeros(2, dtype=torch.float32, device=grad.device)
        if self.scaler is not None:
            stats[0] = float(DynamicLossScaler.local_overflow(grad))
        if self.clip_grad_norm is not None:
            stats[1] = grad.float().pow(2).sum()
        comm.all_reduce(stats, self.engine.group, op="sum")
        found_inf = self.scaler is not None and float(stats[0]) > 0
        norm = stats[1].sqrt().cpu() if self.clip_grad_norm is not None else None
        return found_inf, norm

    def checkpoint_pieces(self) -> list:
        """This rank's optimizer-state pieces for ``pyparallel.checkpoint.save``."""
        from pyparallel.zero import state

        return state.optimizer_pieces(self)

    def load_checkpoint_pieces(self, reader, manifest: dict) -> None:
        from pyparallel.zero import state

        state.load_optimizer_pieces(self, reader, manifest)

    def state_dict(self):
        out = self.inner.state_dict()
        if self.scaler is not None:
            out["loss_scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop("loss_scaler", None)
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        if scaler_state is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.engine.stage}, inner={type(self.inner).__name__})"
