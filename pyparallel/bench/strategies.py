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

import torch

from pyparallel.bench import peers
from pyparallel.bench.adapter import Adapter, Hyper, adamw, dp_rows, library_model_states
from pyparallel.bench.measure import count_model_states
from pyparallel.bench.specs import StrategySpec

__all__ = ["Adapter", "Hyper", "adamw", "build", "dp_rows", "unavailable"]


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
                                          weight_decay=self.hp.weight_decay, offload_optimizer=self.spec.offload,
                                          param_dtype=torch.bfloat16 if self.hp.dtype == "bf16" else None)

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
            group, vocab = self.mesh.tp_group, model._pyparallel_tp["vocab_size"]

            def loss_fn(logits, targets):  # the head's logits stay split by vocabulary (padded past vocab)
                return vocab_parallel_cross_entropy(logits.flatten(0, -2), targets.flatten(), group, vocab_size=vocab)

        v = self.spec.virtual
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


class Parallel(Adapter):
    """``pyparallel.parallelize``: a ZeRO stage on the dp axis of a layout with tp and/or pp (the one
    sharded engine over each pipeline stage's tensor-parallel shards)."""

    def __init__(self, *a):
        super().__init__(*a)
        import pyparallel

        v = self.spec.virtual
        m = self.m if self.mesh.pp > 1 else 1  # micro-batches are a pipeline's; dp x tp steps whole batches
        self.pm = pyparallel.parallelize(self.new_model(), self.mesh, zero_stage=self.spec.zero, num_microbatches=m,
                                         schedule=self.spec.schedule, virtual_stages=v,
                                         optimizer=torch.optim.AdamW, lr=self.hp.lr,
                                         weight_decay=self.hp.weight_decay)
        self.opt = self.pm.optimizer

    def step(self, idx, tgt):
        idx, tgt = (dp_rows(t, self.mesh.dp, self.mesh.dp_rank) for t in (idx, tgt))
        return float(self.pm.step(idx, tgt))  # the mean over the whole global batch, on every rank

    def timing_starts(self):
        if self.mesh.pp > 1:
            self.pm.pipe.reset_stats()

    def model_states(self):
        return library_model_states(self.pm, self.opt, self.dev)

    def stats(self):
        if self.mesh.pp == 1:
            return {}
        st = self.pm.stats()
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
        return peers.build(*args)
    if spec.world == 1:
        return Single(*args)
    if spec.zero and (spec.tp > 1 or spec.pp > 1):
        return Parallel(*args)
    if spec.pp > 1:
        return Pipeline(*args)
    if spec.zero:
        return Zero(*args)
    if spec.tp > 1:
        return TensorParallel(*args)
    return DDP(*args)
