"""What every bench row shares, ours and the peers': the hyper-parameters, the optimizer, this replica's
rows of the global batch, and the :class:`Adapter` base (build on a mesh, one step, what the rank holds).

Every adapter builds the same ``GPT(cfg, seed)`` and an AdamW with the same hyper-parameters, so that
its losses can be compared with the single-process reference step by step.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from pyparallel.bench.specs import StrategySpec
from pyparallel.models.gpt import GPT


@dataclass(frozen=True)
class Hyper:
    """What every strategy trains with (AdamW, Loshchilov & Hutter 2019)."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    # "bf16": bf16 weights and compute, fp32 master weights, optimizer state and gradient reductions (the
    # ZeRO rows and DeepSpeed's; ``BF16_ROWS``). "fp32": everything in fp32.
    dtype: str = "fp32"


def adamw(params, hp: Hyper) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay)


def dp_rows(x: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """This data-parallel replica's contiguous share of the global batch."""
    local = x.shape[0] // dp
    return x[dp_rank * local:(dp_rank + 1) * local]


def library_model_states(model, optimizer, dev: torch.device) -> dict | None:
    """``pyparallel.memory.model_state_bytes(model, optimizer)`` when that module exists, else None.

    ``total`` is the model states (params, grads, optimizer state, fp32 master), not ZeRO's transient
    buffers (kept under ``parts``); on a CPU run the master and optimizer state ZeRO-Offload keeps in host
    memory are added, since there host memory is the memory measured."""
    try:
        memory = importlib.import_module("pyparallel.memory")
    except ImportError:
        return None
    raw = memory.model_state_bytes(model, optimizer)
    host = raw.get("cpu") or {}
    offloaded = int(host.get("master", 0)) + int(host.get("optimizer", 0))
    total = int(raw["model_states"]) + (offloaded if dev.type == "cpu" else 0)
    return {"total": total, "offloaded": offloaded, "parts": raw}


class Adapter:
    """Base: a built strategy on one rank."""

    def __init__(self, spec: StrategySpec, mesh, cfg, hp: Hyper, microbatches: int):
        self.spec, self.mesh, self.cfg, self.hp, self.m = spec, mesh, cfg, hp, microbatches
        self.dev = mesh.device

    def new_model(self) -> GPT:
        return GPT(self.cfg, seed=self.hp.seed).to(self.dev)

    def step(self, idx: torch.Tensor, tgt: torch.Tensor) -> float | None:
        raise NotImplementedError

    def model_states(self) -> dict:
        """This rank's model-state bytes: ``{"total", ...parts}``."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Extra measurements (the pipeline's bubble); called on every rank after the last step."""
        return {}

    def timing_starts(self) -> None:
        """Called before the first timed step (after the warm-up steps)."""
