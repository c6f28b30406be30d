"""Python face of ``torch.ops.pyparallel`` and a plain-torch reference for every op.

The references are the specification: tests compare each compiled kernel against them on random inputs,
and they are the fallback when the extension is absent (``PYPARALLEL_NO_EXT=1``, no compiler to build it on
first use, a failed build: pyparallel/_jit.py) or the device has no kernel, in which case one warning says so.
"""

from __future__ import annotations

import math
import threading
import warnings

import torch

# The extension is looked up (and compiled if the install had no torch to build it: pyparallel/_jit.py) the
# first time an op or one of HAS_EXT / _C / _EXT_ERROR is asked for, not at import, so that importing
# pyparallel (the planner, the CLI) never waits minutes for a compiler.
_load_lock = threading.Lock()


def _ensure_loaded() -> None:
    global HAS_EXT, _C, _EXT_ERROR
    if "HAS_EXT" in globals():
        return
    with _load_lock:
        if "HAS_EXT" in globals():
            return
        from pyparallel import _jit

        module, error = _jit.load()
        if module is not None:
            _register_python_side()
        _C, _EXT_ERROR = module, error
        HAS_EXT = module is not None


def __getattr__(name: str):
    # PEP 562: the first read of HAS_EXT, _C or _EXT_ERROR loads the extension; later reads are plain globals.
    if name in ("HAS_EXT", "_C", "_EXT_ERROR"):
        _ensure_loaded()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_warned = False


def _warn_fallback(op: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        why = _EXT_ERROR or "the extension was built without kernels for this device"
        warnings.warn(
            f"pyparallel: compiled op '{op}' unavailable ({why}); using the plain-torch reference.",
            RuntimeWarning,
            stacklevel=3,
        )


def has_kernel(op: str, device: torch.device) -> bool:
    """True when the extension registered ``op`` for ``device``'s dispatch key."""
    _ensure_loaded()
    if not HAS_EXT:
        return False
    key = "CUDA" if device.type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"pyparallel::{op}", key)


# ---------------------------------------------------------------- flatten / unflatten (buckets)


def flatten_into_reference(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()


def unflatten_from_reference(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    offset = 0
    for t in outs:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def _check_room(tensors, flat, op):
    total = sum(t.numel() for t in tensors)
    if total > flat.numel():
        raise ValueError(f"{op}: tensors hold {total} elements but the flat buffer only {flat.numel()}")


def flatten_into(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ``tensors`` one after another into the 1-D ``out`` (casting if dtypes differ)."""
    _check_room(tensors, out, "flatten_into")
    if has_kernel("flatten_into", out.device):
        torch.ops.pyparallel.flatten_into(list(tensors), out)
    else:
        _warn_fallback("flatten_into")
        flatten_into_reference(tensors, out)


def unflatten_from(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copy consecutive slices of the 1-D ``flat`` back into ``outs``."""
    _check_room(outs, flat, "unflatten_from")
    if has_kernel("unflatten_from", flat.device):
        torch.ops.pyparallel.unflatten_from(flat, list(outs))
    else:
        _warn_fallback("unflatten_from")
        unflatten_from_reference(flat, outs)


# ------------------------------------------------------- tensor parallel: fused GeLU -> row matmul
# y = gelu(z + bias) @ weight.T, the second half of a Megatron MLP (Shoeybi et al. 2019) with the
# row-parallel weight reading the column-parallel pre-activation z. Kernels: csrc/cpu/gelu_linear.cpp,
# csrc/cuda/gelu_linear.cu. Autograd saves z (and the parameters) only and recomputes gelu in backward.

_GELU_FORMS = ("none", "tanh")


def gelu_linear_reference(z, bias, weight, approximate="none"):
    """The specification: ``F.gelu(z + bias, approximate) @ weight.T`` (materializes gelu(z + bias))."""
    zb = z if bias is None else z + bias
    return torch.nn.functional.gelu(zb, approximate=approximate) @ weight.t()


def gelu_linear_backward_reference(grad_out, z, bias, weight, approximate, output_mask):
    """Plain-torch twin of the backward kernel: (grad_z, grad_bias, grad_weight) from z alone."""
    zb = z if bias is None else z + bias
    act = torch.nn.functional.gelu(zb, approximate=approximate)
    rows = math.prod(z.shape[:-1])  # not reshape(-1, ..): defined when a dimension is 0
    gy = grad_out.reshape(rows, weight.shape[0])
    empty = z.new_empty(0)
    dw = gy.t() @ act.reshape(rows, z.shape[-1]) if output_mask[2] else empty  # [N, M] @ [M, K]
    dz = db = empty
    if output_mask[0] or output_mask[1]:
        dz = torch.ops.aten.gelu_backward(grad_out @ weight, zb, approximate=approximate)  # [.., N] @ [N, K]
        db = dz.reshape(rows, z.shape[-1]).sum(0) if output_mask[1] and bias is not None else empty
    return (dz if output_mask[0] else empty), db, dw


class _GeluLinearRecompute(torch.autograd.Function):
    """Fallback with the kernel's memory behaviour: saves z, recomputes gelu(z + bias) in backward."""

    @staticmethod
    def forward(ctx, z, bias, weight, approximate):
        ctx.save_for_backward(z, bias, weight)
        ctx.approximate = approximate
        return gelu_linear_reference(z, bias, weight, approximate)

    @staticmethod
    def backward(ctx, grad_out):
        z, bias, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1] and bias is not None, ctx.needs_input_grad[2]]
        dz, db, dw = gelu_linear_backward_reference(grad_out, z, bias, weight, ctx.approximate, mask)
        return (dz if mask[0] else None), (db if mask[1] else None), (dw if mask[2] else None), None


def _gelu_linear_kernel(device: torch.device) -> bool:
    try:
        return has_kernel("gelu_linear", device) and has_kernel("gelu_linear_backward", device)
    except RuntimeError:  # an extension built before these ops existed
        return False


def gelu_linear(z: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor,
                approximate: str = "none") -> torch.Tensor:
    """``gelu(z + bias) @ weight.T`` without materializing gelu(z + bias); differentiable.

    z [..., K], bias [K] or None, weight [N, K] -> [..., N]. ``approximate`` is "none" (erf) or "tanh",
    as in ``torch.nn.functional.gelu``. Backward keeps only z and recomputes the activation."""
    if approximate not in _GELU_FORMS:
        raise ValueError(f"gelu_linear: approximate must be one of {_GELU_FORMS}, got {approximate!r}")
    if weight.dim() != 2 or z.shape[-1] != weight.shape[1]:
        raise ValueError(f"gelu_linear: z has shape {tuple(z.shape)} and weight {tuple(weight.shape)}; "
                         f"weight must be [out_features, {z.shape[-1]}]")
    if bias is not None and tuple(bias.shape) != (z.shape[-1],):
        raise ValueError(f"gelu_linear: bias has shape {tuple(bias.shape)}, expected ({z.shape[-1]},)")
    if _gelu_linear_kernel(z.device):
        return torch.ops.pyparallel.gelu_linear(z, bias, weight, approximate)
    _warn_fallback("gelu_linear")
    return _GeluLinearRecompute.apply(z, bias, weight, approximate)


def gelu_linear_forward(z: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor,
                        approximate: str = "none") -> torch.Tensor:
    """:func:`gelu_linear`'s forward alone, recording nothing for autograd: for callers that fuse it into
    their own autograd function (the row-parallel layer sums its output in place) and pair it with
    :func:`gelu_linear_backward`."""
    with torch.no_grad():
        if _gelu_linear_kernel(z.device):
            return torch.ops.pyparallel.gelu_linear(z, bias, weight, approximate)
        _warn_fallback("gelu_linear")
        return gelu_linear_reference(z, bias, weight, approximate)


def gelu_linear_backward(grad_out: torch.Tensor, z: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor,
                         approximate: str, output_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_z, grad_bias, grad_weight) of :func:`gelu_linear_forward` from z alone (activation
    recomputed); entries ``output_mask`` leaves out are empty."""
    mask = [bool(m) for m in output_mask]
    if _gelu_linear_kernel(z.device):
        return torch.ops.pyparallel.gelu_linear_backward(grad_out.contiguous(), z, bias, weight, approximate, mask)
    return gelu_linear_backward_reference(grad_out, z, bias, weight, approximate, mask)


def _gelu_linear_setup(ctx, inputs, output):
    z, bias, weight, approximate = inputs
    ctx.save_for_backward(z, bias, weight)
    ctx.approximate = approximate


def _gelu_linear_backward(ctx, grad_out):
    z, bias, weight = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1] and bias is not None, ctx.needs_input_grad[2]]
    dz, db, dw = torch.ops.pyparallel.gelu_linear_backward(grad_out.contiguous(), z, bias, weight,
                                                           ctx.approximate, mask)
    return (dz if mask[0] else None), (db if mask[1] else None), (dw if mask[2] else None), None


# ------------------------------------------------------- optimizers: fused Adam / AdamW
# One pass per element over param, grad, m, v (Adam: Kingma & Ba 2015; decoupled weight decay: Loshchilov &
# Hutter 2019), optionally writing a bf16/fp16 copy of the updated param in the same pass (the copy
# ZeRO-Offload ships back to the GPU, Ren et al. 2021). Kernels: csrc/cpu/adam.cpp (SIMD chosen at run
# time, all threads), csrc/cuda/adam.cu. Python optimizer: pyparallel/optim/cpu_adam.py.


def adam_step_reference(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lowp_out, step, lr, beta1, beta2,
                        eps, weight_decay, adamw, maximize, amsgrad):
    """The specification: torch.optim.Adam's single-tensor update (``_single_tensor_adam``), in fp32.

    Low-precision params are updated through an fp32 copy and rounded back; ``lowp_out[i]`` (when given)
    receives the updated param rounded to its dtype."""
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    step_size = lr / bias_correction1
    for i, param in enumerate(params):
        p = param if param.dtype == torch.float32 else param.float()
        grad = grads[i].float()
        grad = -grad if maximize else grad
        if weight_decay != 0:
            if adamw:
                p.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(p, alpha=weight_decay)
        exp_avgs[i].lerp_(grad, 1 - beta1)
        exp_avg_sqs[i].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sqs[i], out=max_exp_avg_sqs[i])
            denom = (max_exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(exp_avgs[i], denom, value=-step_size)
        if p is not param:
            param.copy_(p)
        if lowp_out:
            lowp_out[i].copy_(p)


def _adam_kernel(device: torch.device) -> bool:
    try:
        return has_kernel("adam_step", device)
    except RuntimeError:  # an extension built before this op existed
        return False


def adam_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
              exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor] | None = None,
              lowp_out: list[torch.Tensor] | None = None, *, step: int, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float = 0.0, adamw: bool = True, maximize: bool = False,
              amsgrad: bool = False) -> None:
    """One Adam/AdamW step over lists of tensors, in place (``step`` counts from 1).

    params fp32 (bf16/fp16 also on CUDA), grads fp32/bf16/fp16, states fp32, all contiguous and on one
    device. ``max_exp_avg_sqs`` is needed with ``amsgrad``; ``lowp_out`` (bf16/fp16, one per param) receives
    the updated params rounded, written in the same pass."""
    max_exp_avg_sqs = list(max_exp_avg_sqs or [])
    lowp_out = list(lowp_out or [])
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n):
        raise ValueError(f"adam_step: {n} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs and "
                         f"{len(exp_avg_sqs)} exp_avg_sqs; the lists must have one entry per param")
    if amsgrad and len(max_exp_avg_sqs) != n:
        raise ValueError(f"adam_step: amsgrad needs {n} max_exp_avg_sqs, got {len(max_exp_avg_sqs)}")
    if lowp_out and len(lowp_out) != n:
        raise ValueError(f"adam_step: lowp_out holds {len(lowp_out)} tensors for {n} params")
    if step < 1:
        raise ValueError(f"adam_step: step counts from 1, got {step}")
    if n == 0:
        return
    args = (int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw),
            bool(maximize), bool(amsgrad))
    if _adam_kernel(params[0].device):
        torch.ops.pyparallel.adam_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                                       max_exp_avg_sqs, lowp_out, *args)
    else:
        _warn_fallback("adam_step")
        adam_step_reference(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lowp_out, *args)




# -------------------------------------------------------- fake kernels and autograd of the compiled ops
# Registered once the library has loaded (the schemas come from it); hasattr guards an extension built
# before an op existed.


def _register_python_side() -> None:
    ops = torch.ops.pyparallel

    def fake(name):
        return torch.library.register_fake(f"pyparallel::{name}")

    @fake("flatten_into")
    def _flatten_into_fake(tensors, out):
        return None

    @fake("unflatten_from")
    def _unflatten_from_fake(flat, outs):
        return None

    if hasattr(ops, "gelu_linear"):

        @fake("gelu_linear")
        def _gelu_linear_fake(z, bias, weight, approximate="none"):
            return z.new_empty((*z.shape[:-1], weight.shape[0]))

        @fake("gelu_linear_backward")
        def _gelu_linear_backward_fake(grad_out, z, bias, weight, approximate, output_mask):
            def maybe(flag, shape):
                return z.new_empty(shape if flag else (0,))

            has_bias = bias is not None
            return (maybe(output_mask[0], z.shape), maybe(output_mask[1] and has_bias, (z.shape[-1],)),
                    maybe(output_mask[2], tuple(weight.shape)))

        torch.library.register_autograd("pyparallel::gelu_linear", _gelu_linear_backward,
                                        setup_context=_gelu_linear_setup)

    if hasattr(ops, "adam_step"):

        @fake("adam_step")
        def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, lowp_out, step, lr, beta1,
                            beta2, eps, weight_decay, adamw, maximize, amsgrad):
            return None
