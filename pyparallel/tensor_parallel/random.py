"""Dropout under tensor parallelism: a model-parallel random state beside the default one.

Megatron-LM (Shoeybi et al. 2019, §3, "Hybrid Model and Data Parallelism" and its
``tensor_parallel/random.py``) keeps two random states per rank:

* the **default generator**, seeded identically on every rank of a TP group, for dropout on activations
  every TP rank holds whole (the residual stream after a row-parallel all-reduce, the embedding output):
  the ranks must drop the same elements or the replicas stop being replicas;
* a **model-parallel state** seeded ``seed + offset + tp_rank``, for dropout on activations that are split
  over the TP group (the attention probabilities of this rank's heads; with sequence parallelism, this
  rank's slice of the sequence): each rank must draw its own mask, or head ``h`` and head ``h + a/t`` are
  dropped alike.

``ModelParallelRNG.fork(device)`` swaps the model-parallel state into the default generator of ``device``
for the ``with`` block (so that dropout inside ``F.scaled_dot_product_attention`` or any Hugging Face
attention draws from it without being told) and swaps it back, keeping the advanced state for the next
fork. Each mesh has its own (groups are passed, never global: :func:`tracker`).

What equals one process exactly: a TP rank r's mask over its heads is what the one-process model gets if
it draws, per layer, from ``seed_of(r)``'s stream and concatenates the ranks' masks by head (and, under
sequence parallelism, by sequence): tests/test_tp_dropout.py builds that reference. What does not: the
one-process model with plain dropout draws its attention masks from the default generator, so its random
numbers differ from any TP run; a TP run is exact and reproducible, not bitwise one-process dropout.

Activation checkpointing: the recomputed forward must draw the same masks. torch.utils.checkpoint replays
the default generators, not this state; pass ``context_fn=checkpoint_context`` to a non-reentrant
``torch.utils.checkpoint.checkpoint`` so that it replays every model-parallel state too.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from pyparallel import device as device_mod

# Megatron's offset between the data-parallel seed and the model-parallel ones: any constant works, as long
# as seed + offset + r never collides with a seed some other stream uses.
MODEL_PARALLEL_OFFSET = 2718


def _key(dev: torch.device) -> tuple[str, int | None]:
    dev = torch.device(dev)
    if dev.type == "cuda" and dev.index is None:
        dev = device_mod.current_cuda_device()
    return dev.type, dev.index


class ModelParallelRNG:
    """The model-parallel random state of one TP rank (per device: CPU and each GPU have their own).

    ``seed`` None takes ``torch.initial_seed()`` when first used: the seed the user gave
    ``torch.manual_seed``, which pyparallel already needs equal on every rank (same model everywhere)."""

    def __init__(self, tp_rank: int, seed: int | None = None, offset: int = MODEL_PARALLEL_OFFSET):
        self.tp_rank, self.offset = tp_rank, offset
        self._seed = seed
        self._states: dict[tuple, torch.Tensor] = {}  # model-parallel state per device, while not forked
        self._stash: dict[tuple, torch.Tensor] = {}  # the default state per device, while forked
        _LIVE.add(self)

    @property
    def seed(self) -> int:
        if self._seed is None:
            self._seed = torch.initial_seed()
        return self._seed

    def manual_seed(self, seed: int) -> None:
        """Restart every device's model-parallel stream from ``seed`` (not inside a fork)."""
        if self._stash:
            raise RuntimeError("ModelParallelRNG.manual_seed inside fork(): leave the fork first")
        self._seed, self._states = int(seed), {}

    def seed_of(self, tp_rank: int | None = None) -> int:
        """The seed of TP rank ``tp_rank``'s model-parallel stream (this rank's by default)."""
        return self.seed + self.offset + (self.tp_rank if tp_rank is None else tp_rank)

    @contextlib.contextmanager
    def fork(self, device: torch.device | str = "cpu"):
        """Draw from this rank's model-parallel stream inside the block (on ``device``'s default generator).
        Re-entrant: a fork inside a fork of the same device is the same fork."""
        key = _key(device)
        if key in self._stash:
            yield
            return
        dev = torch.device(*key) if key[1] is not None else torch.device(key[0])
        if key not in self._states:
            self._states[key] = device_mod.seeded_rng_state(self.seed_of(), dev)
        self._stash[key] = device_mod.rng_state(dev)
        device_mod.set_rng_state(self._states.pop(key), dev)
        try:
            yield
        finally:
            self._states[key] = device_mod.rng_state(dev)
            device_mod.set_rng_state(self._stash.pop(key), dev)

    @contextlib.contextmanager
    def replicated(self, device: torch.device | str = "cpu"):
        """Inside a fork, draw from the default stream again (dropout on replicated activations that sits
        inside a module forked as a whole, e.g. GPT-2's ``resid_dropout`` inside its attention)."""
        key = _key(device)
        if key not in self._stash:
            yield
            return
        dev = torch.device(*key) if key[1] is not None else torch.device(key[0])
        forked = device_mod.rng_state(dev)
        device_mod.set_rng_state(self._stash[key], dev)
        try:
            yield
        finally:
            self._stash[key] = device_mod.rng_state(dev)
            device_mod.set_rng_state(forked, dev)

    def get_states(self) -> dict:
        """A copy of every device's model-parallel state (for a checkpointed forward to replay)."""
        if self._stash:
            raise RuntimeError("ModelParallelRNG.get_states inside fork()")
        return {"seed": self._seed, "states": {k: v.clone() for k, v in self._states.items()}}

    def set_states(self, saved: dict) -> None:
        if self._stash:
            raise RuntimeError("ModelParallelRNG.set_states inside fork()")
        self._seed = saved["seed"]
        self._states = {k: v.clone() for k, v in saved["states"].items()}


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every tracker, for checkpoint_context
_BY_MESH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tracker(mesh) -> ModelParallelRNG:
    """The model-parallel RNG of ``mesh``'s TP group on this rank (one per mesh, made on first use)."""
    try:
        rng = _BY_MESH.get(mesh)
        if rng is None:
            rng = _BY_MESH[mesh] = ModelParallelRNG(mesh.tp_group.rank)
    except TypeError:  # a mesh-like object without weak references (a test's namespace): keep it on the object
        rng = getattr(mesh, "_pyparallel_rng", None)
        if rng is None:
            rng = ModelParallelRNG(mesh.tp_group.rank)
            mesh._pyparallel_rng = rng
    return rng


def manual_seed(mesh, seed: int) -> None:
    """Seed for dropout under TP: the default generators (CPU and every GPU) with ``seed`` -- the same on
    every rank -- and ``mesh``'s model-parallel stream with ``seed + offset + tp_rank``."""
    device_mod.manual_seed_all(seed)
    tracker(mesh).manual_seed(seed)


@contextlib.contextmanager
def _replay(saved: list):
    after = [(rng, rng.get_states()) for rng, _ in saved]
    for rng, states in saved:
        rng.set_states(states)
    try:
        yield
    finally:
        for rng, states in after:
            rng.set_states(states)


def checkpoint_context():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: records every
    model-parallel state when the forward runs and replays it for the recomputation (then puts the states
    back as the forward left them), as torch does for the default generators."""
    saved = [(rng, rng.get_states()) for rng in list(_LIVE)]
    return contextlib.nullcontext(), _replay(saved)


# ------------------------------------------------------------------ Hugging Face modules tensor parallelism splits
# parallelize keeps a Hugging Face attention module and splits the linear layers inside it, so its whole
# forward runs on this rank's heads: it runs inside fork(), and the dropouts that act on replicated
# activations (after the row-parallel all-reduce) step back out. By class: the nn.Dropout children known to
# act on replicated activations, and those known to act on split ones (a float such as LLaMA's
# attention_dropout is always on the attention probabilities, i.e. split). Any other dropout with p > 0 is
# refused: run on the wrong stream it would silently desynchronize the replicas or correlate the heads.
REPLICATED_DROPOUTS = {"GPT2Attention": ("resid_dropout",)}
SPLIT_DROPOUTS = {"GPT2Attention": ("attn_dropout",)}


def check_split_module(module: torch.nn.Module, name: str) -> None:
    cls = type(module).__name__
    known = REPLICATED_DROPOUTS.get(cls, ()) + SPLIT_DROPOUTS.get(cls, ())
    for child, sub in module.named_modules():
        if child and isinstance(sub, torch.nn.Dropout) and sub.p > 0 and child not in known:
            raise ValueError(
                f"{name}.{child}: dropout (p={sub.p}) inside {cls}, whose heads or features tensor parallelism "
                f"splits, and pyparallel does not know whether it acts on split or replicated activations; set its "
                f"p to 0 (or train in eval mode), or leave {name} whole in the plan")


def fork_module(module: torch.nn.Module, rng: ModelParallelRNG) -> None:
    """Run ``module``'s training forward inside ``rng.fork`` (its known replicated dropouts outside)."""
    for child in REPLICATED_DROPOUTS.get(type(module).__name__, ()):
        sub = getattr(module, child)
        sub.forward = _wrapped(sub.forward, sub, rng.replicated)
    module.forward = _wrapped(module.forward, module, rng.fork)


def _wrapped(forward, module, region):
    def run(*args, **kwargs):
        if not module.training:  # no dropout: leave the generators alone
            return forward(*args, **kwargs)
        param = next(module.parameters(), None)
        with region(param.device if param is not None else _first_tensor_device(args, kwargs)):
            return forward(*args, **kwargs)

    return run


def _first_tensor_device(args, kwargs) -> torch.device:
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value):
            return value.device
    return torch.device("cpu")
