"""One small adapter per pyparallel strategy: build the model and its wrapper on a mesh, run one optimizer
step on this rank's share of the global batch, and say what the rank holds.

Every adapter builds the same ``GPT(cfg, seed)`` and an AdamW with the same hyper-parameters, so that
its losses can be compared with the single-process reference step by step. ``step`` receives the whole
global batch (every rank makes the same one from the seed) and takes its own rows; it returns the mean
loss over its replica's rows (a pipeline returns the whole batch's, on every stage), or None on ranks that
see no loss (the stages of PyTorch's pipeline before the last).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from pyparallel.bench.measure import count_model_states
from pyparallel.bench.specs import StrategySpec
from pyparallel.models.gpt import GPT


@dataclass(frozen=True)
class Hyper:
    """What every strategy trains with (AdamW, Loshchilov & Hutter 2019)."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0


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


class Single(Adapter):
    """One process on the whole batch: the reference every other row is checked against."""

    def __init__(self, *a):
        super().__init__(*a)
        self.model = self.new_model()
        self.opt = adamw(self.model.parameters(), self.hp)

    def step(self, idx, tgt):
        self.opt.zero_grad(set_to_none=False)  # grads stay allocated after the step: they are state
        loss = self.model(idx, tgt)
        loss.backward()
        self.opt.step()
        return loss.item()

    def model_states(self):
        wrapper = getattr(self, "wrapped", self.model)  # DataParallel: its buckets are the gradients
        return (library_model_states(wrapper, self.opt, self.dev)
                or count_model_states(self.model.parameters(), [self.opt]))


class DDP(Single):
    """``pyparallel.DataParallel`` over the dp axis (Li et al. 2020): bucketed, overlapped all-reduce."""

    def __init__(self, *a):
        Adapter.__init__(self, *a)
        from pyparallel import DataParallel

        self.model = self.new_model()
        self.wrapped = DataParallel(self.model, self.mesh)
        self.opt = adamw(self.model.parameters(), self.hp)

    def step(self, idx, tgt):
        idx, tgt = (dp_rows(t, self.mesh.dp, self.mesh.dp_rank) for t in (idx, tgt))
        self.opt.zero_grad(set_to_none=False)  # the gradients are views into the buckets: keep them
        loss = self.wrapped(idx, tgt)
        loss.backward()
        self.opt.step()
        return loss.item()


class Zero(Single):
    """``pyparallel.zero.setup`` at the spec's stage (Rajbhandari et al. 2020), optionally with the
    optimizer state offloaded to host memory (ZeRO-Offload, Ren et al. 2021)."""

    def __init__(self, *a):
        Adapter.__init__(self, *a)
        from pyparallel import zero

        self.model, self.opt = zero.setup(self.new_model(), self.mesh, stage=self.spec.zero,
                                          optimizer=torch.optim.AdamW, lr=self.hp.lr,
                                          weight_decay=self.hp.weight_decay, offload_optimizer=self.spec.offload)

    def step(self, idx, tgt):
        idx, tgt = (dp_rows(t, self.mesh.dp, self.mesh.dp_rank) for t in (idx, tgt))
        self.opt.zero_grad()
        loss = self.model(idx, tgt)
        loss.backward()
        self.opt.step()
        return loss.item()

    def model_states(self):
        out = library_model_states(self.model, self.opt, self.dev)
        if out is None:
            raise NotImplementedError("ZeRO rows need pyparallel.memory.model_state_bytes")
        return out


class TensorParallel(DDP):
    """``pyparallel.tensor_parallel.parallelize`` (Megatron layers over the tp axis), under
    ``DataParallel`` when the layout also has a dp axis."""

    def __init__(self, *a):
        Adapter.__init__(self, *a)
        from pyparallel import DataParallel
        from pyparallel.tensor_parallel import parallelize

        self.model = parallelize(self.new_model(), self.mesh)
        self.wrapped = DataParallel(self.model, self.mesh) if self.mesh.dp > 1 else self.model
        self.opt = adamw(self.model.parameters(), self.hp)


class Pipeline(Adapter):
    """``pyparallel.pipeline_parallel.PipelineParallel`` with the spec's schedule; a tp axis is
    ``parallelize``d first, a dp axis reduced by the pipeline itself."""

    def __init__(self, *a):
        super().__init__(*a)
        from pyparallel.pipeline_parallel import PipelineParallel

        model = self.new_model()
        loss_fn = None
        if self.mesh.tp > 1:
            from pyparallel.tensor_parallel import parallelize, vocab_parallel_cross_entropy

            model = parallelize(model, self.mesh)
            group = self.mesh.tp_group

            def loss_fn(logits, targets):  # the head's logits stay split by vocabulary
                return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), group)

        v = self.spec.virtual if self.spec.schedule == "interleaved" else 1
        self.pipe = PipelineParallel(model, self.mesh, schedule=self.spec.schedule, num_microbatches=self.m,
                                     virtual_stages=v, loss_fn=loss_fn)
        self.opt = adamw(self.pipe.parameters(), self.hp)

    def step(self, idx, tgt):
        idx, tgt = (dp_rows(t, self.mesh.dp, self.mesh.dp_rank) for t in (idx, tgt))
        self.opt.zero_grad(set_to_none=False)
        loss = self.pipe.step(idx, tgt)  # the mean over the whole global batch, on every rank
        self.opt.step()
        return float(loss)

    def timing_starts(self):
        self.pipe.reset_stats()  # the bubble of the timed steps only

    def model_states(self):
        return count_model_states(self.pipe.parameters(), [self.opt])

    def stats(self):
        st = self.pipe.stats()  # a collective over the pipeline group: every stage calls it
        return {"bubble_fraction": st["bubble_measured"], "bubble_theory": st["bubble_theory"]}


_MODULES = {"zero": "pyparallel.zero", "offload": "pyparallel.zero.offload",
            "tp": "pyparallel.tensor_parallel", "pp": "pyparallel.pipeline_parallel",
            "memory": "pyparallel.memory"}


def _needs(spec: StrategySpec) -> list[str]:
    need = []
    if spec.zero:
        need += ["zero", "memory"] + (["offload"] if spec.offload else [])
    if spec.tp > 1:
        need.append("tp")
    if spec.pp > 1:
        need.append("pp")
    return need


def unavailable(spec: StrategySpec) -> str | None:
    """Why this install of pyparallel cannot run ``spec`` (a module missing from it), or None."""
    if spec.is_peer:
        from pyparallel.bench import peers

        return peers.unavailable(spec)
    for key in _needs(spec):
        try:
            importlib.import_module(_MODULES[key])
        except ImportError as exc:
            return f"{_MODULES[key]} is not available in this install ({exc})"
    return None


def build(spec: StrategySpec, mesh, cfg, hp: Hyper, microbatches: int) -> Adapter:
    args = (spec, mesh, cfg, hp, microbatches)
    if spec.is_peer:
        from pyparallel.bench import peers

        return peers.build(*args)
    if spec.world == 1:
        return Single(*args)
    if spec.pp > 1:
        if spec.zero:
            raise ValueError(f"{spec.name}: ZeRO with pipeline parallelism is not benchmarked")
        return Pipeline(*args)
    if spec.zero:
        if spec.tp > 1:
            raise ValueError(f"{spec.name}: ZeRO with tensor parallelism is not benchmarked")
        return Zero(*args)
    if spec.tp > 1:
        return TensorParallel(*args)
    return DDP(*args)
