"""The torch operations a forward applies to the hidden states between its pieces, recorded on the
meta device, so that the pipeline's blocks can be checked to do the same ones as the model's own forward.

Reading a forward's source (:mod:`pyparallel.source`) says which attributes it reads, not what it does with
them: a forward that applies its final norm before the layers too, adds the embeddings back into every
layer's input or scales the hidden states by a constant reads nothing new. This module runs the forward
instead and records its dataflow. A :class:`torch.overrides.TorchFunctionMode` sees every torch function
and tensor method called at the top level of the forward, and a step is recorded when one of its tensor
arguments descends from the input ids. A call of one of the model's modules is recorded as one step,
named by its path in the model; whatever that module does inside is its own business, and the pipeline
runs it unchanged.

The run costs neither memory nor compute. The model is copied to the meta device with its tensors, and
the copy's decoder layers are stubbed, since only their place in the dataflow matters. That also keeps
data-dependent code (a mixture of experts' routing) out of a meta run. The rotary embedding is opaque:
its tables depend on positions, not on the hidden states, and the blocks rebuild them per layer. Two runs
that record the same steps, with the same constants and the same wiring, compute the same function of
the input ids, given the same modules.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode


def stub(module: nn.Module, fn: Callable) -> None:
    """Replace ``module``'s forward with ``fn`` (on a copy made for tracing only)."""
    module.forward = fn


def _is_identity_index(index) -> bool:
    """``x[:, 0:, ...]``-style indexing that keeps every element (HF's ``logits_to_keep=0`` slice)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is Ellipsis or (isinstance(p, slice) and p.start in (None, 0) and p.stop is None
                                 and p.step in (None, 1)) for p in parts)


# Operations that leave the values alone when the output keeps the input's shape, dtype and device (GPT-2's
# ``input_ids.view(-1, seq)``, a ``.to(device)`` onto the device it is on).
_SAME_VALUES = frozenset({"view", "reshape", "to", "contiguous", "clone", "float", "type_as"})


def _same_values(func, name: str, args, kwargs, out) -> bool:
    x = args[0] if args else None
    if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    if name == "dropout":  # F.dropout with p = 0 or out of training draws nothing
        try:
            bound = inspect.signature(func).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return False
        bound.apply_defaults()
        return bound.arguments.get("p") == 0 or bound.arguments.get("training") is False
    if name == "__getitem__":
        return _is_identity_index(args[1])
    return name in _SAME_VALUES and (out.shape, out.dtype, out.device) == (x.shape, x.dtype, x.device)


def _const(value) -> str:
    if isinstance(value, nn.Module):
        return type(value).__name__
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_const(v) for v in value) + ")"
    return repr(value)


class DataflowRecorder(TorchFunctionMode):
    """Records the steps applied to tensors that descend from the seed tensors (:meth:`seed`) or from the
    output of a watched module. Each step is ``(name, arguments)``, where a tensor on the path is written
    ``h<k>``, numbered in the order the path's tensors appear, and any other argument by its value (a
    tensor off the path by its shape and dtype, which is all a meta tensor has). ``watched`` maps modules
    to their names; ``opaque`` modules run without being recorded and their outputs stay off the path."""

    def __init__(self, watched: dict[nn.Module, str], opaque: Iterable[nn.Module] = ()):
        super().__init__()
        self.watched, self.opaque = watched, list(opaque)
        self.steps: list[str] = []
        self._label: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []  # keeps the labelled tensors alive, so their ids stay theirs
        self._next = 0  # the next label
        self._depth = 0
        self._handles = []

    # --------------------------------------------------------------------------------------- labels
    def seed(self, tensor: torch.Tensor) -> None:
        self._put(tensor)

    def label(self, tensor: torch.Tensor) -> str | None:
        k = self._label.get(id(tensor))
        return None if k is None else f"h{k}"

    def _put(self, out, like: torch.Tensor | None = None) -> None:
        if isinstance(out, torch.Tensor):
            self._alive.append(out)
            if like is not None:
                self._label[id(out)] = self._label[id(like)]
            else:
                self._label[id(out)], self._next = self._next, self._next + 1
        elif isinstance(out, (tuple, list)):
            for o in out:
                self._put(o)

    def _on_path(self, values) -> bool:
        return any(isinstance(v, torch.Tensor) and id(v) in self._label for v in _flat(values))

    def _arg(self, value) -> str:
        if isinstance(value, torch.Tensor):
            return self.label(value) or _const(value)
        if isinstance(value, (tuple, list)):
            return "(" + ", ".join(self._arg(v) for v in value) + ")"
        return _const(value)

    def _args(self, func, args, kwargs) -> str:
        try:  # a Python function's arguments by name, positional or not (F.dropout(x, p) = F.dropout(x, p=p))
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            parts = [f"{k}={self._arg(v)}" for k, v in bound.arguments.items()]
        except (TypeError, ValueError):
            parts = [self._arg(a) for a in args] + [f"{k}={self._arg(v)}" for k, v in sorted(kwargs.items())]
        return ", ".join(parts)

    # ------------------------------------------------------------------------------------ recording
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._depth or not any(isinstance(o, torch.Tensor) for o in _flat(out)) or \
                not self._on_path((args, kwargs)):
            return out  # inside a module, metadata (.shape, .dtype, .device), or off the path
        name = getattr(func, "__name__", str(func))
        if _same_values(func, name, args, kwargs, out):
            self._put(out, like=args[0])
            return out
        step = f"{name}({self._args(func, args, kwargs)})"
        self._put(out)
        self.steps.append(f"{self._arg(out)} = {step}")
        return out

    def __enter__(self):
        for module, name in [*self.watched.items(), *((m, None) for m in self.opaque)]:
            self._handles += [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                              module.register_forward_hook(self._post(name), with_kwargs=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)

    def _pre(self, module, args, kwargs):
        if not self._depth:
            self._call = (args, kwargs)
        self._depth += 1

    def _post(self, name: str | None):
        def hook(module, args, kwargs, out):
            self._depth -= 1
            if self._depth or name is None:
                return None
            args, kwargs = self._call
            wired = [self._arg(v) for v in _flat((args, kwargs)) if isinstance(v, torch.Tensor) and self.label(v)]
            self._put(out)
            first = next((o for o in _flat(out) if isinstance(o, torch.Tensor)), None)
            self.steps.append(f"{self._arg(first)} = {name}({', '.join(wired)})")
            return None
        return hook


def _flat(values):
    if isinstance(values, dict):
        for v in values.values():
            yield from _flat(v)
    elif isinstance(values, (tuple, list)):
        for v in values:
            yield from _flat(v)
    else:
        yield values
