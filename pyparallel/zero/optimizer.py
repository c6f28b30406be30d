"""The optimizer a user holds for a sharded model (``zero.setup`` and ``parallelize`` return the same one).

It is a ``torch.optim.Optimizer`` facade over the engine's inner optimizer: ``param_groups`` are the inner
optimizer's, one per user parameter group in the user's order (LR schedulers work unchanged), ``state`` is
this rank's runs only; ``step()`` reduces what backward has not, checks and clips by the global norm,
updates this rank's elements and hands every rank the new weights; ``zero_grad()`` clears the gradients.
"""

from __future__ import annotations

import torch

from pyparallel.zero import pieces


class ShardOptimizer(torch.optim.Optimizer):
    """See the module docstring. After a step: ``last_grad_norm`` (the global norm before clipping, when
    ``clip_grad_norm`` is set), ``scaler`` (fp16 only: ``scaler.scale``, ``scaler.skipped_steps``),
    ``last_step_skipped``."""

    def __init__(self, engine):
        self.engine = engine
        self.inner = engine.optimizer
        # Every flat group gives every rank at least one element, so there is always a tensor to hold.
        super().__init__([p for g in self.inner.param_groups for p in g["params"]], dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.last_step_skipped = False
        self._built = True

    @property
    def scaler(self):
        return self.engine.scaler

    @property
    def last_grad_norm(self) -> float | None:
        return self.engine.last_grad_norm

    @property
    def clip_grad_norm(self) -> float | None:
        return self.engine.clip_grad_norm

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise ValueError("a sharded optimizer's param_groups are fixed at setup (they cover flat shards); pass "
                             "every group as param_groups= to pyparallel.zero.setup / pyparallel.parallelize")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_skipped = not self.engine.step()
        return loss

    def checkpoint_pieces(self) -> list:
        """This rank's optimizer-state pieces for ``pyparallel.checkpoint.save``."""
        return pieces.optimizer_pieces(self.engine)

    def load_checkpoint_pieces(self, reader, manifest: dict) -> None:
        pieces.load_optimizer(self.engine, reader, manifest)
        self.state = self.inner.state

    def state_dict(self):
        out = self.inner.state_dict()
        if self.scaler is not None:
            out["loss_scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop("loss_scaler", None)
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        if scaler_state is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)

    def __repr__(self) -> str:
        return f"ShardOptimizer(stage={self.engine.stage}, inner={type(self.inner).__name__})"
