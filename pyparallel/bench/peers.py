"""PyTorch's own implementations of each strategy, on the same model, data and optimizer (``--peers``).

These rows are what a user would pick instead of pyparallel: ``torch.nn.parallel.DistributedDataParallel``,
``ZeroRedundancyOptimizer`` (ZeRO-1 style optimizer-state sharding), FSDP2 ``fully_shard`` per block
(ZeRO-3; ``reshard_after_forward=False`` is ZeRO-2 style), DTensor tensor parallelism with
``ColwiseParallel``/``RowwiseParallel`` (the Megatron split) and ``torch.distributed.pipelining`` with
``Schedule1F1B``. They run on the process groups of a pyparallel mesh. PyTorch's wrappers issue their own
collectives, which ``pyparallel.comm`` does not see: their rows have no measured traffic (DeepSpeed's,
in bench/deepspeed_peers.py, do: its comms logger counts them). The one
collective the bench itself needs here (summing the tied embedding's gradient between the first and
last pipeline stage) goes through ``pyparallel.comm``.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyparallel import comm
from pyparallel.bench import deepspeed_peers
from pyparallel.bench.adapter import Adapter, adamw, dp_rows
from pyparallel.bench.measure import count_model_states

_NEEDS = {
    "torch-ddp": ["torch.nn.parallel"],
    "torch-zero1": ["torch.distributed.optim"],
    "torch-fsdp2": ["torch.distributed.fsdp"],
    "torch-fsdp2-zero2": ["torch.distributed.fsdp"],
    "torch-tp": ["torch.distributed.tensor.parallel"],
    "torch-pp-1f1b": ["torch.distributed.pipelining"],
    "torch-fsdp2xtp": ["torch.distributed.fsdp", "torch.distributed.tensor.parallel"],
}


def unavailable(spec) -> str | None:
    if spec.name in deepspeed_peers.ROWS:
        return deepspeed_peers.unavailable()
    for module in _NEEDS.get(spec.name, []):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"this torch has no {module} ({exc})"
    return None


def _device_mesh(group: comm.Group, dev: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group.pg, dev.type)


class TorchDDP(Adapter):
    def __init__(self, *a):
        super().__init__(*a)
        from torch.nn.parallel import DistributedDataParallel

        self.model = self.new_model()
        ids = [self.dev.index] if self.dev.type == "cuda" else None
        self.wrapped = DistributedDataParallel(self.model, device_ids=ids, process_group=self.mesh.dp_group.pg,
                                               gradient_as_bucket_view=True)
        self.opt = self.make_optimizer()

    def make_optimizer(self):
        return adamw(self.model.parameters(), self.hp)

    def step(self, idx, tgt):
        idx, tgt = (dp_rows(t, self.mesh.dp, self.mesh.dp_rank) for t in (idx, tgt))
        self.opt.zero_grad(set_to_none=False)
        loss = self.wrapped(idx, tgt)
        loss.backward()
        self.opt.step()
        return loss.item()

    def optimizers(self):
        return [self.opt]

    def model_states(self):
        return count_model_states(self.model.parameters(), self.optimizers())


class TorchZero1(TorchDDP):
    """DDP for the gradients, ZeroRedundancyOptimizer for the optimizer state (each rank updates and
    broadcasts its shard of the parameters)."""

    def make_optimizer(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.AdamW,
                                       process_group=self.mesh.dp_group.pg, lr=self.hp.lr,
                                       weight_decay=self.hp.weight_decay)

    def optimizers(self):
        return [self.opt.optim]  # the local optimizer over this rank's shard


class TorchFSDP2(TorchDDP):
    """FSDP2: every block its own all-gather unit, then the root (embeddings, final norm, tied head)."""

    reshard = True

    def __init__(self, *a):
        Adapter.__init__(self, *a)
        from torch.distributed.fsdp import fully_shard

        self.model = self.new_model()
        dm = _device_mesh(self.mesh.dp_group, self.dev)
        for block in self.model.blocks:
            fully_shard(block, mesh=dm, reshard_after_forward=self.reshard)
        fully_shard(self.model, mesh=dm, reshard_after_forward=self.reshard)
        self.wrapped = self.model
        self.opt = adamw(self.model.parameters(), self.hp)


class TorchFSDP2Zero2(TorchFSDP2):
    reshard = False  # parameters stay gathered from forward to backward: ZeRO-2's traffic


class TorchTP(TorchDDP):
    """DTensor TP: Q/K/V and fc_in column-parallel, o_proj and fc_out row-parallel (Shoeybi et al. 2019);
    embeddings, norms and the tied head replicated."""

    def __init__(self, *a):
        Adapter.__init__(self, *a)
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.model = self.new_model()
        dm = _device_mesh(self.mesh.tp_group, self.dev)
        plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}
        for block in self.model.blocks:
            parallelize_module(block, dm, plan)
        self.wrapped = self.model
        self.opt = adamw(self.model.parameters(), self.hp)

    def step(self, idx, tgt):
        self.opt.zero_grad(set_to_none=False)
        loss = self.model(idx, tgt)
        loss.backward()
        self.opt.step()
        return loss.item()


class TorchFSDP2TP(TorchTP):
    """torchtitan's 2-D layout: DTensor TP over the tp axis inside each block, then FSDP2 ``fully_shard``
    per block and at the root over the dp axis of one 2-D ``DeviceMesh`` (TP shards sharded again over DP)."""

    def __init__(self, *a):
        Adapter.__init__(self, *a)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.mesh
        ranks = torch.tensor([[mesh.rank_of(dp=d, tp=t, pp=0) for t in range(mesh.tp)] for d in range(mesh.dp)])
        dm = DeviceMesh.from_group([mesh.dp_group.pg, mesh.tp_group.pg], self.dev.type, mesh=ranks,
                                   mesh_dim_names=("dp", "tp"))
        self.model = self.new_model()
        plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}
        for block in self.model.blocks:
            parallelize_module(block, dm["tp"], plan)
            fully_shard(block, mesh=dm["dp"])
        fully_shard(self.model, mesh=dm["dp"])
        self.wrapped = self.model
        self.opt = adamw(self.model.parameters(), self.hp)

    def step(self, idx, tgt):
        idx, tgt = (dp_rows(t, self.mesh.dp, self.mesh.dp_rank) for t in (idx, tgt))
        return super().step(idx, tgt)


class _Stage(nn.Module):
    """A contiguous slice of the GPT for one pipeline rank: embeddings first, blocks, head last."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.head = model.head if last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TorchPipeline(Adapter):
    """torch.distributed.pipelining, Schedule1F1B over the pp axis. The first and the last stage each hold
    the tied embedding; their gradients are summed before the optimizer step so the copies stay equal."""

    def __init__(self, *a):
        super().__init__(*a)
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        pp, rank = self.mesh.pp, self.mesh.pp_rank
        model = self.new_model()
        per, extra = divmod(self.cfg.n_layer, pp)
        bounds = [s * per + max(0, s - (pp - extra)) for s in range(pp + 1)]  # the last stages take extras
        self.first, self.last = rank == 0, rank == pp - 1
        self.module = _Stage(model, bounds[rank], bounds[rank + 1], self.first, self.last)
        self.tied = model.embed.wte.weight if (self.first or self.last) and self.cfg.tie_embeddings else None
        stage = PipelineStage(self.module, rank, pp, self.dev, group=self.mesh.pp_group.pg)
        self.schedule = Schedule1F1B(stage, n_microbatches=self.m, loss_fn=_lm_loss)
        self.opt = adamw(self.module.parameters(), self.hp)

    def step(self, idx, tgt):
        self.opt.zero_grad(set_to_none=False)
        losses: list = []
        if self.first:
            self.schedule.step(idx)
        elif self.last:
            self.schedule.step(target=tgt, losses=losses)
        else:
            self.schedule.step()
        if self.cfg.tie_embeddings and self.mesh.pp > 1:
            if self.tied is None:  # inner stages take part with zeros: the group is the whole pipeline
                grad = torch.zeros(self.cfg.vocab_size, self.cfg.n_embd, device=self.dev)
            else:
                if self.tied.grad is None:
                    self.tied.grad = torch.zeros_like(self.tied)
                grad = self.tied.grad
            comm.all_reduce(grad, self.mesh.pp_group)
        self.opt.step()
        return float(torch.stack(losses).detach().mean()) if self.last else None

    def model_states(self):
        return count_model_states(self.module.parameters(), [self.opt])


PEERS = {"torch-ddp": TorchDDP, "torch-zero1": TorchZero1, "torch-fsdp2": TorchFSDP2,
         "torch-fsdp2-zero2": TorchFSDP2Zero2, "torch-tp": TorchTP, "torch-pp-1f1b": TorchPipeline,
         "torch-fsdp2xtp": TorchFSDP2TP}


def build(spec, mesh, cfg, hp, microbatches) -> Adapter:
    if spec.name in deepspeed_peers.ROWS:
        return deepspeed_peers.build(spec, mesh, cfg, hp, microbatches)
    return PEERS[spec.name](spec, mesh, cfg, hp, microbatches)
