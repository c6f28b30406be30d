"""Models built on the meta device (``with torch.device("meta"): model = LlamaForCausalLM(config)``):
giving their tensors storage, values and buffers, as torchtitan (``to_empty`` + ``init_weights``), FSDP and
DeepSpeed's ``zero.Init`` do.

Two sources of values:

* ``weights=``: a safetensors file or Hugging Face folder (``checkpoint.weights``); each rank reads only
  its pieces, after the wrapper has laid out its shards (the wrapper calls :func:`load`).
* no weights: every module that owns meta parameters is given storage (``to_empty``) and initialised by
  ``init(name, module)`` when given, else by the root's ``init_module(name, module)`` when it has one (the
  built-in GPT), else by its own ``reset_parameters()`` followed by a Hugging Face model's
  ``_init_weights`` (as ``from_config`` initialises: RMSNorm and other modules without
  ``reset_parameters()`` get the latter alone), under ``torch.manual_seed`` of a seed
  derived from the module's qualified name (:func:`seed_of`). The values therefore depend on neither the
  order nor the process: the same calls in one process give the same model.

Buffers are rebuilt, not left on meta: persistent ones come from the weights when the file has them;
non-persistent ones (rotary ``inv_freq``) are recomputed by the Hugging Face model's ``_init_weights``.

``zero.setup`` calls :func:`initialize` on the whole model. The other wrappers (``tensor_parallel.parallelize``,
``PipelineParallel``, ``pyparallel.parallelize``, ``DataParallel``) call :func:`open_source` first, split the
model on meta, and fill what the rank keeps piece by piece through their checkpoint loaders, from the weights
or from an :class:`InitReader`, which runs the same seeded initialisation on one full-size module at a time:
a rank's shards are then exactly the slices of the one-process :func:`initialize`.
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


def default_init(root: nn.Module, init=None):
    """``init``, else the root's own ``init_module(name, module)`` (the built-in GPT's), else None."""
    return init if init is not None else getattr(root, "init_module", None)


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
    hf, init = _hf_init(model), default_init(model, init)
    owners = []  # modules in registration order, each with the parameters it is the first to hold
    seen: set[int] = set()
    for name, module in model.named_modules():
        mine = [p for p in module._parameters.values() if p is not None and p.is_meta and id(p) not in seen]
        seen.update(id(p) for p in mine)
        if mine:
            owners.append((name, module))
    empty_params(model, device)
    for name, module in owners:
        init_one(name, module, init, hf)
    rebuild_buffers(model, device)


def _cannot_init(name: str, module: nn.Module) -> ValueError:
    return ValueError(f"module '{name}' ({type(module).__name__}) holds meta parameters and has no "
                      f"reset_parameters(): pass weights= (a safetensors file or Hugging Face folder) "
                      f"or init=callable(name, module) to initialise it")


def seeded_default(model: nn.Module, seed: int):
    """An ``init`` that runs the default initialisation (below) under ``seed_of(name, seed)`` instead of
    ``seed_of(name)``: another random model, still independent of the process and the order."""
    hf = _hf_init(model)
    return lambda name, module: init_one(name, module, None, hf, base=seed)


def init_one(name: str, module: nn.Module, init, hf, base: int = 0) -> None:
    """One module's initialisation under the seed of its name, leaving the caller's random state as it was:
    ``init``; else what ``from_config`` does, the module's ``reset_parameters()`` (its constructor's values)
    then the Hugging Face model's ``_init_weights``, either one where the other is missing."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_of(name, base))
        if init is not None:
            init(name, module)
            return
        if not hasattr(module, "reset_parameters") and hf is None:
            raise _cannot_init(name, module)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if hf is not None:
            hf(module)


@torch.no_grad()
def rebuild_buffers(model: nn.Module, device: torch.device, loadable=frozenset(), only=None) -> None:
    """Buffers still on meta get storage on ``device``; non-persistent ones are recomputed by a Hugging Face
    model's ``_init_weights`` (persistent ones named in ``loadable`` are filled by the weights later).
    ``only``: ids of the modules to consider (a pipeline stage's), None for all."""
    hf = _hf_init(model)
    for name, module in model.named_modules():
        if only is not None and id(module) not in only:
            continue
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
    """Storage (uninitialised) for meta parameters whose values a loader writes next (frozen parameters)."""
    for t in tensors:
        if t.is_meta:
            bind(t, torch.empty_like(t, device=device))


def bind(p: nn.Parameter, tensor: torch.Tensor) -> None:
    """Make ``tensor`` the data of parameter ``p``, in place: the same Python object, so ties (one Parameter
    under several modules), names recorded by id and gradient hooks registered on it survive. ``p.data =``
    refuses to move a tensor off the meta device, so a meta parameter swaps its implementation instead;
    its gradient hooks live with the implementation and are installed again on the new one."""
    if not p.is_meta:
        p.data = tensor
        return
    hooks, post = p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None)
    torch.utils.swap_tensors(p, nn.Parameter(tensor, requires_grad=p.requires_grad))
    if hooks:
        p._backward_hooks = None
        p._backward_hooks = hooks  # setting the dict registers it with the new implementation
    if post:
        p._post_accumulate_grad_hooks = None
        p._post_accumulate_grad_hooks = post


@torch.no_grad()
def allocate(params, device: torch.device) -> None:
    """Zero-filled storage on ``device`` for every distinct meta parameter of ``params``, in place (see
    :func:`bind`). Zeros, not empty: rows no piece of the weights covers (TP vocabulary padding) must be zero."""
    seen: set[int] = set()
    for p in params:
        if p.is_meta and id(p) not in seen:
            seen.add(id(p))
            bind(p, torch.zeros(p.shape, dtype=p.dtype, device=device))


# ------------------------------------------------------------------------- the wrappers' one entry point


def open_source(model, device: torch.device, weights=None, init=None):
    """Where a wrapper's meta model gets its values, decided before anything changes and before any collective:
    a checked ``checkpoint.weights.WeightsReader`` for ``weights`` (ValueError naming missing, unexpected and
    mis-shaped tensors), an :class:`InitReader` for a meta model without weights, or None for a model with
    real tensors (which the wrapper uses as it is). Both readers are read piece by piece by the wrappers' own
    checkpoint loaders, so a sharded rank fills exactly its slices."""
    if weights is not None:
        if init is not None:
            raise ValueError("pass weights= or init=, not both (init initialises a meta model that has no weights)")
        if not isinstance(model, nn.Module):
            raise ValueError(f"weights= needs the model itself (the built-in GPT or a Hugging Face model), whose "
                             f"parameter names the file uses, not a {type(model).__name__}")
        from pyparallel.checkpoint.weights import open_weights

        return open_weights(weights, model)
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    meta = sum(p.is_meta for p in params)
    if not meta:
        if init is not None:
            raise ValueError("init= only applies to a model built on the meta device (this one has real tensors)")
        return None
    if meta != len(params):
        raise ValueError(f"{meta} of the model's {len(params)} parameters are on the meta device and the others are "
                         f"not: build the whole model on the meta device (and pass weights= or init=), or none of it")
    return InitReader(model, device, init)


def loadable(model, reader) -> set:
    """Names of the persistent buffers (and parameters) that ``reader`` fills; the other meta buffers are
    recomputed (:func:`rebuild_buffers`)."""
    if reader is None or isinstance(reader, InitReader):
        return set()
    from pyparallel.checkpoint.weights import expected_of

    return set(expected_of(model)[0])


@torch.no_grad()
def load_in_place(wrapper, reader, device: torch.device) -> None:
    """Zero storage for the meta parameters a wrapper holds on this rank (its TP shards, its pipeline stage,
    a replica) and their values from ``reader``, piece by piece (``checkpoint.modules.load_module``: each
    piece is a box of the unsplit tensor, so a TP rank reads only its rows or columns; vocabulary padding
    rows are in no piece and stay zero)."""
    from pyparallel.checkpoint.modules import describe_model, load_module

    infos, *_ = describe_model(wrapper)
    allocate([p for _, p in infos], device)
    load_module(wrapper, reader)


class InitReader:
    """The reader of a meta model without weights: ``WeightsReader``'s calls (``names``, ``has``, ``full``,
    ``piece``), each tensor computed by initialising the module that holds it first (registration order, as
    :func:`initialize` does) at full size under ``seed_of(its name)``, with ``init(name, module)``, else its
    ``reset_parameters()``, else the Hugging Face model's ``_init_weights``. The module gets fresh full-size
    parameters for the call only, so the model's own (meta, or this rank's shard) are never touched, and only
    the last module's tensors are kept: a sharded rank holds its slices plus one module in flight, and its
    slices are exactly those of the one-process :func:`initialize` split afterwards. ``init`` must set only
    the module's own parameters (not its children's). Built before the model is split: it keeps the original
    modules (on meta, no memory)."""

    prefix = "model/"

    def __init__(self, model: nn.Module, device: torch.device, init=None):
        self.path = "the initialisation of the meta model"
        init = default_init(model, init)
        self.device, self.init, self.hf = device, init, _hf_init(model)
        canonical = {id(p): n for n, p in model.named_parameters()}
        self._owner: dict[str, tuple[str, nn.Module, str]] = {}  # parameter name -> (module name, module, attr)
        self._attrs: dict[str, list[str]] = {}  # module name -> the attributes of the parameters it holds first
        seen: set[int] = set()
        for name, module in model.named_modules():
            mine = [(a, p) for a, p in module._parameters.items() if p is not None and id(p) not in seen]
            seen.update(id(p) for _, p in mine)
            if not mine:
                continue
            if init is None and not hasattr(module, "reset_parameters") and self.hf is None:
                raise _cannot_init(name, module)  # before the wrapper changes anything
            for attr, p in mine:
                self._owner[canonical[id(p)]] = (name, module, attr)
            self._attrs[name] = [a for a, _ in mine]
        self._cached: tuple[str | None, dict] = (None, {})

    def names(self):
        return [self.prefix + n for n in self._owner]

    def has(self, name: str) -> bool:
        return name.startswith(self.prefix) and name[len(self.prefix):] in self._owner

    @torch.no_grad()
    def full(self, name: str) -> torch.Tensor:
        owner, module, attr = self._owner[name[len(self.prefix):]]
        if self._cached[0] != owner:
            self._cached = (None, {})  # the previous module's tensors go first
            attrs = self._attrs[owner]
            saved = {a: module._parameters[a] for a in attrs}
            try:
                for a, p in saved.items():
                    module._parameters[a] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                                         requires_grad=p.requires_grad)
                init_one(owner, module, self.init, self.hf)
                values = {a: module._parameters[a].detach() for a in attrs}
            finally:
                module._parameters.update(saved)
            self._cached = (owner, values)
        return self._cached[1][attr]

    def piece(self, piece) -> torch.Tensor:
        """The piece's flat data: its box of the initialised tensor, permuted, then the range."""
        full = self.full(piece.name)
        if tuple(full.shape) != tuple(piece.global_shape):
            raise ValueError(f"{piece.name}: initialised with shape {tuple(full.shape)}, the layout expects "
                             f"{tuple(piece.global_shape)}")
        box = full[tuple(slice(o, o + s) for o, s in zip(piece.box_offsets, piece.box_shape))]
        if piece.perm:
            box = box.permute(*piece.perm)
        return box.reshape(-1)[piece.flat_start:piece.flat_start + piece.flat_len]
