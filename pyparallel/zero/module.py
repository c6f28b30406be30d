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
from pyparallel.zero import pieces


class ZeroModule(nn.Module):
    """A module trained with ZeRO stage 1, 2 or 3. ``module`` is the wrapped model.

    ``no_sync()``: gradient accumulation. Stage 1 accumulates full gradients locally inside it and
    communicates nothing; stages 2 and 3 accept it but still reduce-scatter every micro-batch into their
    gradient shards (deferring would mean keeping full gradients, the memory they exist to save). Any
    stage also accumulates correctly when backward is simply called several times before ``step()``.

    ``full_state_dict()`` (a collective) returns every parameter at full size in fp32 (from the master
    weights), by the names of ``module.named_parameters()`` before wrapping.
    """

    def __init__(self, module: nn.Module, engine, policy: amp.MixedPrecision, mesh=None):
        super().__init__()
        self.module = module
        self.mesh = mesh  # pyparallel.checkpoint.save finds the groups here
        self._engine = engine
        self._cast_dtype = policy.param_dtype if policy.param_dtype not in (None, torch.float32) else None
        self._scaler = engine.scaler
        self._buffer_names = [n for n, _ in module.named_buffers()]
        if engine.gatherer is not None:  # the flat shards are this model's parameters now
            self.flat_shards = nn.ParameterList(engine.gatherer.shard_params)

    @property
    def stage(self) -> int:
        return self._engine.stage

    @property
    def engine(self):
        return self._engine

    def forward(self, *args, **kwargs):
        if self._cast_dtype is not None:
            args, kwargs = amp.cast_inputs(args, kwargs, self._cast_dtype)
        gatherer = self._engine.gatherer
        out = gatherer.run_forward(self.module, args, kwargs) if gatherer is not None else self.module(*args, **kwargs)
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

    def _piece_buffers(self):
        first = self.mesh is None or self.mesh.dp_rank == 0
        return [(n, b, first) for n, b in self.module.named_buffers()]

    def checkpoint_pieces(self) -> list:
        """This rank's pieces for ``pyparallel.checkpoint.save`` (``pyparallel.zero.pieces``)."""
        return pieces.model_pieces(self._engine, self._piece_buffers(), self.mesh is None or self.mesh.dp_rank == 0)

    def load_checkpoint_pieces(self, reader, manifest: dict) -> None:
        """Called by ``pyparallel.checkpoint.load`` on every rank (a collective in stages 1-2)."""
        pieces.load_model(self._engine, reader, self._piece_buffers())

    @torch.no_grad()
    def full_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every parameter at full size by its original name, on every rank (a collective over the DP group)."""
        from pyparallel.checkpoint import gather_full

        out = gather_full(self.checkpoint_pieces(), self._engine.group)
        return {k: v.to(dtype) for k, v in out.items() if k not in set(self._buffer_names)}
