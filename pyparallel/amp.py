"""Mixed-precision policy and dynamic loss scaling.

Mixed-precision training (Micikevicius et al. 2018, "Mixed Precision Training") computes in a 16-bit
format and keeps an fp32 master copy of the weights that the optimizer updates; ZeRO (Rajbhandari et al.
2020, section 3.1) counts exactly these 2 + 2 + 12 bytes per parameter. :class:`MixedPrecision` says which
dtype each part uses:

* ``param_dtype``: the weights forward and backward compute with (and that stage 3 all-gathers).
  ``None`` means "keep the module's dtype" (plain fp32 training, no master copy).
* ``reduce_dtype``: the dtype gradients are summed in across ranks and kept in as shards. fp32 by default
  even for bf16 compute: gloo sums bf16 in bf16 (about 0.8 % error at 3 ranks), and an fp32 gradient shard
  is what a torch optimizer on an fp32 master needs anyway.

fp16 has a narrow exponent range, so small gradients underflow: :class:`DynamicLossScaler` multiplies the
gradients entering the model by a scale S (equivalent to scaling the loss) and divides them out before the
update. A step whose gradients overflowed is skipped and S halved; after ``growth_interval`` clean steps S
doubles. In data-parallel training the overflow decision must be the same on every rank (else ranks'
weights diverge): the caller all-reduces the overflow flag before calling :meth:`DynamicLossScaler.update`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtype compute weights and gradient reductions use (see module docstring)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.param_dtype is not None and self.param_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"param_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {self.param_dtype!r}")
        if self.reduce_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"reduce_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {self.reduce_dtype!r}")

    def compute_dtype(self, module_dtype: torch.dtype) -> torch.dtype:
        """The dtype the model computes in: ``param_dtype``, or the module's own dtype when None."""
        return self.param_dtype or module_dtype

    def has_master(self, module_dtype: torch.dtype) -> bool:
        """True when the compute weights are narrower than fp32, so an fp32 master copy is kept."""
        return self.compute_dtype(module_dtype) != torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16

    def describe(self) -> str:
        p = _dtype_name(self.param_dtype) if self.param_dtype else "module dtype"
        return f"compute {p}, reduce {_dtype_name(self.reduce_dtype)}"


class DynamicLossScaler:
    """Dynamic loss scale for fp16 (Micikevicius et al. 2018, section 3.2; the policy of torch's GradScaler).

    ``scale`` starts at ``init_scale``; :meth:`update` with ``found_inf=True`` multiplies it by
    ``backoff_factor`` (and never lets it drop below ``min_scale``); ``growth_interval`` consecutive clean
    steps multiply it by ``growth_factor``. Counters: ``skipped_steps``, ``good_steps``.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0):
        if init_scale <= 0 or min_scale <= 0:
            raise ValueError(f"init_scale ({init_scale}) and min_scale ({min_scale}) must be positive")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.skipped_steps = 0
        self.good_steps = 0
        self._since_growth = 0

    @staticmethod
    def local_overflow(tensor: torch.Tensor) -> bool:
        """True when ``tensor`` holds an inf or NaN (this rank's view only; all-reduce before deciding)."""
        return not bool(torch.isfinite(tensor).all())

    def update(self, found_inf: bool) -> None:
        """Advance the schedule after a step; ``found_inf`` must already agree across ranks."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.skipped_steps += 1
            self._since_growth = 0
            return
        self.good_steps += 1
        self._since_growth += 1
        if self._since_growth >= self.growth_interval:
            self.scale *= self.growth_factor
            self._since_growth = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "skipped_steps": self.skipped_steps, "good_steps": self.good_steps,
                "since_growth": self._since_growth}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.skipped_steps = int(state["skipped_steps"])
        self.good_steps = int(state["good_steps"])
        self._since_growth = int(state["since_growth"])

    def __repr__(self) -> str:
        return f"DynamicLossScaler(scale={self.scale:g}, skipped={self.skipped_steps})"


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by the scaler's current scale.

    Applied to a model's outputs, this scales every gradient inside the model by S exactly as
    ``(loss * S).backward()`` would (backward is linear), while ``loss.item()`` still reads the true loss,
    so the user's loop stays ``loss.backward()``."""

    @staticmethod
    def forward(ctx, x, scaler):
        ctx.scaler = scaler
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scaler.scale, None


def scale_outputs(outputs, scaler: DynamicLossScaler):
    """Route every floating tensor in ``outputs`` (a tensor, or a tuple/list/dict of them) that requires grad
    through :class:`_ScaleGrad`."""
    from torch.utils._pytree import tree_map

    def wrap(t):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            return _ScaleGrad.apply(t, scaler)
        return t

    return tree_map(wrap, outputs)


def cast_inputs(args, kwargs, dtype: torch.dtype):
    """Cast floating tensors in a forward's arguments to the compute dtype (integer tokens pass through)."""
    from torch.utils._pytree import tree_map

    def cast(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return tree_map(cast, args), tree_map(cast, kwargs)
