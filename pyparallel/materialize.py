"""Models built on the meta device (``with torch.device("meta"): model = LlamaForCausalLM(config)``):
giving their tensors storage, values and buffers, as torchtitan (``to_empty`` + ``init_weights``), FSDP and
DeepSpeed's ``zero.Init`` do.

Two sources of values:

* ``weights=``: a safetensors file or Hugging Face folder (``checkpoint.weights``); each rank reads only
  its pieces, after the wrapper has laid out its shards (the wrapper calls :func:`load`).
* no weights: every module that owns meta parameters is given storage (``to_empty``) and initialised by
  ``init(name, module)`` when given, else by its own ``reset_parameters()`` (a Hugging Face model's
  ``_init_weights`` for modules without one, such as RMSNorm), under ``torch.manual_seed`` of a seed
  derived from the module's qualified name (:func:`seed_of`). The values therefore depend on neither the
  order nor the process: the same calls in one process give the same model.

Buffers are rebuilt, not left on meta: persistent ones come from the weights when the file has them;
non-persistent ones (rotary ``inv_freq``) are recomputed by the Hugging Face model's ``_init_weights``.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def seed_of(name: str, base: int = 0) -> int:
    """The seed a module's default initialisation runs under: its qualified name's CRC-32 plus ``base``."""
    return (zlib.crc32(name.encode()) + base) % 2**63


def _hf_init(root: nn.Module):
    return getattr(root, "_init_weights", None) if hasattr(root, "config") else None


@torch.no_grad()
def empty_params(model: nn.Module, device: torch.device) -> None:
    """Storage (uninitialised) on ``device`` for every meta parameter, keeping ties: a parameter registered
    under several modules (a tied embedding / LM head) stays one parameter. ``nn.Module.to_empty`` makes a
    new Parameter per registration when leaving the meta device, which silently unties them."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            module._parameters[attr] = new[id(p)]


@torch.no_grad()
def initialize(model: nn.Module, device: torch.device, init=None) -> None:
    """Give every meta parameter storage on ``device`` and values (see the module docstring)."""
    hf = _hf_init(model)
    owners = []  # modules in registration order, each with the parameters it is the first to hold
    seen: set[int] = set()
    for name, module in model.named_modules():
        mine = [p for p in module._parameters.values() if p is not None and p.is_meta and id(p) not in seen]
        seen.update(id(p) for p in mine)
        if mine:
            owners.append((name, module))
    empty_params(model, device)
    for name, module in owners:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_of(name))
            if init is not None:
                init(name, module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif hf is not None:
                hf(module)
            else:
                raise ValueError(f"module '{name}' ({type(module).__name__}) holds meta parameters and has no "
                                 f"reset_parameters(): pass weights= (a safetensors file or Hugging Face folder) "
                                 f"or init=callable(name, module) to initialise it")
    rebuild_buffers(model, device)


@torch.no_grad()
def rebuild_buffers(model: nn.Module, device: torch.device, loadable=frozenset()) -> None:
    """Buffers still on meta get storage on ``device``; non-persistent ones are recomputed by a Hugging Face
    model's ``_init_weights`` (persistent ones named in ``loadable`` are filled by the weights later)."""
    hf = _hf_init(model)
    for name, module in model.named_modules():
        meta = [b for b, t in module._buffers.items() if t is not None and t.is_meta]
        if not meta:
            continue
        for b in meta:
            module._buffers[b] = torch.empty_like(module._buffers[b], device=device)
        derived = [b for b in meta if f"{name}.{b}".lstrip(".") not in loadable]
        if not derived:
            continue
        if hf is None or any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"buffer(s) {derived} of module '{name}' ({type(module).__name__}) are on the meta "
                             f"device and pyparallel cannot recompute them; create the model's buffers on a real "
                             f"device or ship them in the weights")
        hf(module)  # e.g. a rotary embedding's inv_freq from its config


@torch.no_grad()
def empty_like_meta(tensors, device: torch.device) -> None:
    """Storage (uninitialised) for meta tensors whose values a loader writes next (frozen parameters)."""
    for t in tensors:
        if t.is_meta:
            t.data = torch.empty_like(t, device=device)
