"""Fused Adam / AdamW backed by ``torch.ops.pyparallel.adam_step``.

``CPUAdam`` is the host optimizer of ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training", section 5.1): one pass per element over param, grad and the two moments
(28 bytes of memory traffic per fp32 parameter), SIMD-vectorised (AVX-512, AVX2 or scalar, chosen at run
time; ``PYPARALLEL_SIMD`` forces one) and spread over all threads. It can write a bf16/fp16 copy of the
updated weights in the same pass (``step(lowp_out=...)``), which is what offload ships back to the GPU.

``FusedAdam`` is the same optimizer on any device with a kernel (CUDA: one multi-tensor launch per step).
The update is torch.optim.Adam's (Kingma & Ba 2015) with ``adamw=False`` (L2 added to the gradient) and
torch.optim.AdamW's (Loshchilov & Hutter 2019) with ``adamw=True``; state dicts are interchangeable with
theirs (keys ``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from pyparallel import _ops

_LOWP = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def simd_level() -> str:
    """The SIMD level the CPU kernel uses now: "avx512", "avx2" or "scalar" ("reference" without the
    extension, when the plain-torch reference runs instead)."""
    return _ops._C.simd_level() if _ops.HAS_EXT else "reference"


def supported_simd_levels() -> list[str]:
    """The levels this CPU can run, widest first."""
    return list(_ops._C.supported_simd_levels()) if _ops.HAS_EXT else []


def set_simd_level(level: str) -> str:
    """Force the CPU kernel's SIMD level ("avx512", "avx2", "scalar" or "auto"); returns the previous one.

    Raises ValueError for a level this CPU cannot run. The environment variable ``PYPARALLEL_SIMD`` does
    the same for a whole process (read on first use)."""
    if not _ops.HAS_EXT:
        raise ValueError("set_simd_level: the pyparallel._C extension is not built; no SIMD kernel to configure")
    try:
        return _ops._C.set_simd_level(level)
    except RuntimeError as exc:
        raise ValueError(str(exc).splitlines()[0]) from None


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    if not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"Invalid betas: {betas}; each must lie in [0, 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW with one fused kernel call per step over all parameters of a device.

    Args mirror torch.optim.Adam; ``adamw=True`` (the default) decays weights decoupled as AdamW does,
    ``adamw=False`` adds ``weight_decay * p`` to the gradient as Adam does. amsgrad and maximize are
    supported. Params must be contiguous; fp32 everywhere, plus bf16/fp16 params with fp32 state on CUDA.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw: bool = True, maximize: bool = False, amsgrad: bool = False):
        _check_hyper(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw=adamw,
                        maximize=maximize, amsgrad=amsgrad)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._check_param(p)

    def _check_param(self, p: torch.Tensor) -> None:
        if not p.is_contiguous():
            raise ValueError(f"{type(self).__name__}: parameters must be contiguous, got one of shape "
                             f"{tuple(p.shape)} with strides {p.stride()}")
        if p.dtype != torch.float32 and not (p.is_cuda and p.dtype in _LOWP):
            raise ValueError(f"{type(self).__name__}: parameters must be fp32 (bf16/fp16 only on CUDA), got "
                             f"{p.dtype} on {p.device}")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._check_param(p)

    @torch.no_grad()
    def step(self, closure=None, *, lowp_out: Sequence[torch.Tensor | None] | None = None,
             grads: Sequence[torch.Tensor | None] | None = None):
        """One optimizer step.

        lowp_out: one bf16/fp16 tensor (or None) per param, in param_groups order, that receives the
            updated param rounded to its dtype in the same pass (ZeRO-Offload's copy back to the GPU).
        grads: explicit gradients (fp32/bf16/fp16, one per param or None) used instead of ``p.grad``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused_step(self, lowp_out=lowp_out, grads=grads)
        return loss


def can_fuse(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`fused_step` can run ``optimizer``'s update: a FusedAdam / CPUAdam, or exactly
    torch.optim.Adam / AdamW (not a subclass, which may change the math) without ``differentiable``."""
    if isinstance(optimizer, FusedAdam):
        return True
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(g.get("differentiable", False) for g in optimizer.param_groups)


@torch.no_grad()
def fused_step(optimizer: torch.optim.Optimizer, *, lowp_out: Sequence[torch.Tensor | None] | None = None,
               grads: Sequence[torch.Tensor | None] | None = None,
               params: Sequence[torch.Tensor] | None = None) -> None:
    """Runs one step of ``optimizer`` (see :func:`can_fuse`) with the fused kernel, reading its
    ``param_groups`` and ``state`` afresh each time, so LR schedules and ``load_state_dict`` apply. The
    state it keeps is torch.optim.Adam's (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``).
    ``lowp_out`` and ``grads`` are as in :meth:`FusedAdam.step`, one entry per parameter in the order of
    ``params``: every parameter of the optimizer once, in any order (default: param_groups order). A
    caller that built its param_groups from its own list passes that list, so the entries cannot be paired
    with another group's parameters."""
    if not can_fuse(optimizer):
        raise ValueError(f"fused_step: {type(optimizer).__name__} is not torch.optim.Adam/AdamW or FusedAdam")
    all_params = [p for g in optimizer.param_groups for p in g["params"]]
    if params is None:
        params = all_params
    else:
        params = list(params)
        if len(params) != len(all_params) or {id(p) for p in params} != {id(p) for p in all_params}:
            raise ValueError(f"fused_step: params= must hold each of the optimizer's {len(all_params)} parameters "
                             f"once, got {len(params)} tensors that are not the same set")
    outs = _by_param(lowp_out, params, "lowp_out")
    explicit = _by_param(grads, params, "grads") if grads is not None else None
    default_adamw = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        _step_group(group, optimizer.state, outs, explicit, default_adamw)


def _by_param(values: Sequence | None, params: list[torch.Tensor], what: str) -> dict[int, torch.Tensor]:
    """Maps id(param) -> tensor for a list aligned with all params of all groups (None entries skip)."""
    if values is None:
        return {}
    if len(values) != len(params):
        raise ValueError(f"step: {what} holds {len(values)} entries but the optimizer has {len(params)} "
                         "params (one per param, in param_groups order; None to skip)")
    return {id(p): v for p, v in zip(params, values) if v is not None}


def _init_state(state: dict, p: torch.Tensor, amsgrad: bool) -> dict:
    def zeros():
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    if "exp_avg" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)  # as torch.optim.Adam (non-capturable)
        state["exp_avg"] = zeros()
        state["exp_avg_sq"] = zeros()
    if amsgrad and "max_exp_avg_sq" not in state:
        state["max_exp_avg_sq"] = zeros()
    return state


def _step_counts(steps: list[torch.Tensor]) -> list[int]:
    """Increments the step tensors (one foreach op, as torch's fused Adam does) and reads them back."""
    torch._foreach_add_(steps, 1)
    if len(steps) > 1 and all(t.device.type == "cpu" for t in steps):
        return [int(v) for v in torch.stack(steps).tolist()]  # one read instead of one .item() per param
    return [int(t.item()) for t in steps]


def _step_group(group: dict, states, outs: dict, explicit: dict | None, default_adamw: bool) -> None:
    amsgrad = group["amsgrad"]
    adamw = group.get("adamw", group.get("decoupled_weight_decay", default_adamw))
    work = []
    for p in group["params"]:
        grad = p.grad if explicit is None else explicit.get(id(p))
        if grad is None:
            continue
        if grad.is_sparse:
            raise ValueError("fused Adam does not support sparse gradients")
        if grad.dtype not in _GRAD_DTYPES or grad.numel() != p.numel():
            raise ValueError(f"fused Adam: gradient of {grad.numel()} {grad.dtype} elements for a param of "
                             f"{p.numel()}; expected fp32/bf16/fp16 of the same size")
        work.append((p, grad, _init_state(states[p], p, amsgrad)))
    if not work:
        return
    # One kernel call per (device, step count, with/without a low-precision copy): params whose grads were
    # None on some steps have their own step counts (bias corrections).
    batches: dict[tuple, list[list[torch.Tensor]]] = defaultdict(lambda: [[], [], [], [], [], []])
    for (p, grad, state), step in zip(work, _step_counts([w[2]["step"] for w in work])):
        out = outs.get(id(p))
        b = batches[(p.device, step, out is not None)]
        for k, t in enumerate((p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"])):
            b[k].append(t)
        if amsgrad:
            b[4].append(state["max_exp_avg_sq"])
        if out is not None:
            b[5].append(out)
    beta1, beta2 = group["betas"]
    for (_, step, _), (ps, gs, ms, vs, vmaxs, lowp) in batches.items():
        _ops.adam_step(ps, gs, ms, vs, vmaxs, lowp, step=step, lr=float(group["lr"]), beta1=float(beta1),
                       beta2=float(beta2), eps=group["eps"], weight_decay=group["weight_decay"], adamw=adamw,
                       maximize=group["maximize"], amsgrad=amsgrad)


class CPUAdam(FusedAdam):
    """FusedAdam for parameters in host memory: the SIMD, multi-threaded CPU kernel of ZeRO-Offload.

    ``pyparallel.optim.CPUAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, adamw=True,
    maximize=False, amsgrad=False)``; drop-in for torch.optim.AdamW (``adamw=False``: torch.optim.Adam).
    """

    def _check_param(self, p: torch.Tensor) -> None:
        if p.device.type != "cpu":
            raise ValueError(f"CPUAdam: parameters must live in host memory, got one on {p.device}; use "
                             "pyparallel.optim.FusedAdam (or torch.optim.AdamW(fused=True)) on accelerators")
        super()._check_param(p)
