"""The model object ``pyparallel.zero.setup`` returns: the user's module behind one stage engine.

It keeps the training loop ordinary. ``forward`` casts floating inputs to the compute dtype, runs the
engine (stage 3 gathers the root unit around the call) and, under fp16, routes the outputs through the
loss scaler so that ``loss.backward()`` produces scaled gradients without the user scaling anything.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from pyparallel import amp
from pyparallel.zero import state
from pyparallel.zero.flat_param import gather_named


class ZeroModule(nn.Module):
    """A module trained with ZeRO stage 1, 2 or 3. ``module`` is the wrapped model.

    ``no_sync()``: gradient accumulation. Stage 1 accumulates full gradients locally inside it and
    communicates nothing; stages 2 and 3 accept it but still reduce-scatter every micro-batch into their
    gradient shards (deferring would mean keeping full gradients, the memory they exist to save). Any
    stage also accumulates correctly when backward is simply called several times before ``step()``.

    ``full_state_dict()`` (a collective) returns every parameter at full size in fp32 (from the master
    weights), by the names of ``module.named_parameters()`` before wrapping.
    """

    def __init__(self, module: nn.Module, engine, policy: amp.MixedPrecision,
                 scaler: amp.DynamicLossScaler | None, mesh=None):
        super().__init__()
        self.module = module
        self.mesh = mesh  # pyparallel.checkpoint.save finds the groups here
        self._engine = engine
        self._cast_dtype = policy.param_dtype if policy.param_dtype not in (None, torch.float32) else None
        self._scaler = scaler
        if engine.stage == 3:  # the flat shards are this model's parameters now
            self.flat_shards = nn.ParameterList(engine.shard_params)

    @property
    def stage(self) -> int:
        return self._engine.stage

    @property
    def engine(self):
        return self._engine

    def forward(self, *args, **kwargs):
        if self._cast_dtype is not None:
            args, kwargs = amp.cast_inputs(args, kwargs, self._cast_dtype)
        out = self._engine.run_forward(self.module, args, kwargs)
        if self._scaler is not None and torch.is_grad_enabled():
            out = amp.scale_outputs(out, self._scaler)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        previous, self._engine.sync = self._engine.sync, False
        try:
            yield
        finally:
            self._engine.sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad()

    def checkpoint_pieces(self) -> list:
        """This rank's pieces for ``pyparallel.checkpoint.save`` (see ``pyparallel.zero.state``)."""
        return state.model_pieces(self)

    def load_checkpoint_pieces(self, reader, manifest: dict) -> None:
        """Called by ``pyparallel.checkpoint.load`` on every rank (a collective in stages 1-2)."""
        state.load_model_pieces(self, reader)

    @torch.no_grad()
    def full_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        eng = self._engine
        master = eng.updater.master.to(eng.device)
        out = gather_named(eng.space, master, eng.group, dtype)
        for name, p in eng.frozen:
            out[name] = p.detach().to(dtype).clone()
        return out
