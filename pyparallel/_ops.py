"""Python face of ``torch.ops.pyparallel`` and a plain-torch reference for every op.

The references are the specification: tests compare each compiled kernel against them on random inputs,
and they are the fallback when the extension is absent (``PYPARALLEL_NO_EXT=1``, a failed build) or the
device has no kernel, in which case one warning says so.
"""

from __future__ import annotations

import warnings

import torch

try:
    from pyparallel import _C  # noqa: F401  (loading it registers torch.ops.pyparallel.*)

    HAS_EXT = True
    _EXT_ERROR: str | None = None
except ImportError as exc:  # pure-Python install or a broken build
    HAS_EXT = False
    _EXT_ERROR = str(exc)

_warned = False


def _warn_fallback(op: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        why = _EXT_ERROR or "the extension was built without kernels for this device"
        warnings.warn(
            f"pyparallel: compiled op '{op}' unavailable ({why}); using the plain-torch reference. "
            "Reinstall with `pip install --no-build-isolation -e .` for the fast kernels.",
            RuntimeWarning,
            stacklevel=3,
        )


def has_kernel(op: str, device: torch.device) -> bool:
    """True when the extension registered ``op`` for ``device``'s dispatch key."""
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


if HAS_EXT:

    @torch.library.register_fake("pyparallel::flatten_into")
    def _flatten_into_fake(tensors, out):
        return None

    @torch.library.register_fake("pyparallel::unflatten_from")
    def _unflatten_from_fake(flat, outs):
        return None
