"""The data-parallel half of a DP x TP x PP model: gradient reduction, ties, the global checks and the
(optionally ZeRO-sharded) optimizer step over one pipeline stage's tensor-parallel parameters.

Layout. A rank's trainable parameters are laid end to end in flat groups (``zero.flat_param``): buckets
of ``bucket_cap_mb``, except that a weight tied across pipeline stages (the GPT's ``wte`` / ``lm_head``)
gets a group of its own, so that its group has the same layout on every stage that holds it. ZeRO stages
1 and 2 (Rajbhandari et al. 2020, sections 5.1-5.2) pad each group to a multiple of the DP degree N and
keep slice ``dp_rank`` of it; stage 0 (plain data parallelism) keeps all of it (N = 1 in the index
arithmetic). The rank's master weights (fp32), gradient shard and optimizer state are each one
contiguous tensor over its slices, updated by one element-wise optimizer call (exact for Adam, SGD, ...).

Gradients. The pipeline's loss is pre-scaled by each micro-batch's share of the *global* token count, so
gradients are **summed** (not averaged) over micro-batches and over the DP group; they are then the
gradients of the mean loss over the global batch.

* Stages 0 and 1 accumulate full gradients in one flat buffer of the reduce dtype (a parameter's
  ``.grad`` is a view into it when the dtypes agree; otherwise a hook adds the compute-dtype gradient in
  and drops it, so bf16 micro-batch gradients are summed in fp32). At the step: stage 0 all-reduces it,
  stage 1 reduce-scatters it into the shard.
* Stage 2 keeps no full gradient between backward passes: as soon as every parameter of a group has its
  gradient (in each micro-batch's backward), the group is reduce-scattered asynchronously and added into
  this rank's gradient shard, in group order (so every DP rank issues the same collectives).
* A weight tied across stages is then summed over the stages holding it, on its own group's slice
  (Megatron-LM's embedding all-reduce, Shoeybi et al. 2019, done on 1/N of the tensor).

The global checks are one all-reduce over the world of (overflow flag, squared gradient norm): every
element is counted exactly once (shards are disjoint; a tensor replicated over TP counts on TP rank 0, a
tied copy on its first stage, a stage-0 replica on DP rank 0), so clipping equals
``clip_grad_norm_`` on the unparallelised model and every rank skips the same fp16 overflow steps.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn as nn

from pyparallel import comm
from pyparallel.amp import DynamicLossScaler
from pyparallel.zero.flat_param import FlatLayout, ShardSpace, plan_buckets
from pyparallel.zero.step import DeviceUpdater


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class DPEngine:
    """Gradient reduction and optimizer step over ``named`` = [(ParamInfo, parameter)] (see module doc)."""

    def __init__(self, named, mesh, *, stage: int, compute_dtype, reduce_dtype, master_dtype, cap_bytes: int,
                 tie_groups: dict, optimizer_factory, offload: bool = False, fuse: bool = True,
                 scaler: DynamicLossScaler | None = None, clip_grad_norm: float | None = None):
        self.mesh, self.stage, self.device = mesh, stage, mesh.device
        self.group = mesh.dp_group
        self.compute_dtype, self.reduce_dtype, self.master_dtype = compute_dtype, reduce_dtype, master_dtype
        self.scaler, self.clip_grad_norm = scaler, clip_grad_norm
        self.last_grad_norm: float | None = None
        self.infos = {id(p): info for info, p in named}
        trainable = [(info.name, p) for info, p in named if p.requires_grad]
        self.frozen = [(info, p) for info, p in named if not p.requires_grad]
        if not trainable:
            raise ValueError("this pipeline stage has no trainable parameters: nothing to optimize")
        self.world = self.group.size if stage >= 1 else 1
        self.rank = self.group.rank if stage >= 1 else 0
        tied = [(n, p) for n, p in trainable if id(p) in tie_groups]
        rest = [(n, p) for n, p in trainable if id(p) not in tie_groups]
        self.layouts = [FlatLayout([n], [p], self.world) for n, p in tied]
        self.tie_groups = [(g, tie_groups[id(p)]) for g, (_, p) in enumerate(tied)]
        if rest:
            self.layouts += plan_buckets(rest, cap_bytes, self.world, _elem(compute_dtype))
        self.space = ShardSpace(self.layouts, self.rank)
        self._where = {id(p): (g, i) for g, lay in enumerate(self.layouts) for i, p in enumerate(lay.params)}
        master = self._build_master()
        self.params_in_master = stage == 0 and compute_dtype == master_dtype and not offload
        self._bind_params(master)
        self.updater = self._make_updater(master, optimizer_factory, offload, fuse)
        self._init_grads()
        self._runs, self._all_counted = self._count_runs()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in trainable]

    # ----------------------------------------------------------------------------------------- setup

    @torch.no_grad()
    def _build_master(self) -> torch.Tensor:
        master = self.space.new(self.master_dtype, self.device)
        for g, lay in enumerate(self.layouts):
            full = lay.flatten(lay.params, self.master_dtype, self.device)
            a, b = lay.shard_range(self.rank)
            self.space.slice(master, g).copy_(full[a:b])
        return master

    @torch.no_grad()
    def _bind_params(self, master: torch.Tensor) -> None:
        """Every trainable parameter becomes a view of a flat compute-dtype buffer (stage 0 in fp32: of the
        master itself), which the step refreshes; frozen parameters are cast to the compute dtype."""
        if self.params_in_master:
            self.flats = [self.space.slice(master, g) for g in range(len(self.layouts))]
        elif self.stage == 0:
            self.compute = master.to(self.compute_dtype)
            self.flats = [self.space.slice(self.compute, g) for g in range(len(self.layouts))]
        else:
            self.flats = [lay.flatten(lay.params, self.compute_dtype, self.device) for lay in self.layouts]
        for lay, flat in zip(self.layouts, self.flats):
            for p, view in zip(lay.params, lay.views(flat)):
                p.data = view
        for _, p in self.frozen:
            if p.is_floating_point() and p.dtype != self.compute_dtype:
                p.data = p.data.to(self.compute_dtype)

    def _make_updater(self, master, factory, offload: bool, fuse: bool):
        if offload:
            from pyparallel.zero.offload import OptimizerOffload

            return OptimizerOffload(master.clone(), factory, self.device)
        return DeviceUpdater(master, factory, self.device, fuse=fuse)

    def _init_grads(self) -> None:
        self.full_grad = None
        self.grad_shard = self.space.new(self.reduce_dtype, self.device) if self.stage >= 1 else None
        self._grad_views: list[list[torch.Tensor]] = []
        self._full_views: list[torch.Tensor] = []
        if self.stage < 2:
            total = sum(lay.padded for lay in self.layouts)
            self.full_grad = torch.zeros(total, dtype=self.reduce_dtype, device=self.device)
            offset = 0
            for lay in self.layouts:
                full = self.full_grad[offset:offset + lay.padded]
                self._full_views.append(full)
                self._grad_views.append(lay.views(full))
                offset += lay.padded
        self._attach_grads()
        self._live: list[torch.Tensor | None] = [None] * len(self.layouts)
        self._missing = [len(lay.params) for lay in self.layouts]
        self._round, self._next = False, 0
        self._pending: deque = deque()

    def _attach_grads(self) -> None:
        if self.stage < 2 and self.reduce_dtype == self.compute_dtype:
            for lay, views in zip(self.layouts, self._grad_views):
                for p, v in zip(lay.params, views):
                    p.grad = v  # autograd accumulates in place, straight into the buffer

    def _count_runs(self):
        """Shard-space ranges whose squares enter the global gradient norm (see module doc)."""
        dp_owner = self.stage >= 1 or self.mesh.dp_rank == 0
        runs, all_counted = [], dp_owner
        for g, lay in enumerate(self.layouts):
            a, b = lay.shard_range(self.rank)
            base = self.space.offsets[g]
            for p, o, n in zip(lay.params, lay.offsets, lay.numels):
                if not (dp_owner and self.infos[id(p)].counted):
                    all_counted = False
                    continue
                lo, hi = max(a, o), min(b, o + n)
                if lo < hi:
                    s, e = base + lo - a, base + hi - a
                    if runs and runs[-1][1] == s:
                        runs[-1] = (runs[-1][0], e)
                    else:
                        runs.append((s, e))
        return runs, all_counted

    # ------------------------------------------------------------------------------- backward hooks

    def _on_grad(self, p: nn.Parameter) -> None:
        g, i = self._where[id(p)]
        if self.stage < 2:
            view = self._grad_views[g][i]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.add_(p.grad)
                p.grad = view if view.dtype == p.dtype else None
            return
        if not self._round:
            self._round, self._next = True, 0
            self._missing = [len(lay.params) for lay in self.layouts]
            torch.autograd.Variable._execution_engine.queue_callback(self._end_round)
        lay = self.layouts[g]
        if self._live[g] is None:
            self._live[g] = torch.zeros(lay.padded, dtype=self.reduce_dtype, device=self.device)
        o, n = lay.offsets[i], lay.numels[i]
        self._live[g][o:o + n].add_(p.grad.reshape(-1))
        p.grad = None
        self._missing[g] -= 1
        while self._next < len(self.layouts) and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, g: int) -> None:
        """Stage 2: reduce-scatter group ``g``'s gradients of this backward (sum) into the shard."""
        full = self._live[g]
        if full is None:  # no gradient reached the group on this rank: contribute zeros
            full = torch.zeros(self.layouts[g].padded, dtype=self.reduce_dtype, device=self.device)
        self._live[g] = None
        out = torch.empty(self.layouts[g].shard_numel, dtype=self.reduce_dtype, device=self.device)
        handle = comm.reduce_scatter(out, full, self.group, op="sum", async_op=True)
        self._pending.append((handle, full, out, g))
        while len(self._pending) > 2:  # bounds the full-size gradient buffers alive at once
            self._complete()

    def _complete(self) -> None:
        handle, _full, out, g = self._pending.popleft()
        handle.wait()
        self.space.slice(self.grad_shard, g).add_(out)

    def _end_round(self) -> None:
        self._round = False
        while self._next < len(self.layouts):
            self._launch(self._next)
            self._next += 1
        while self._pending:
            self._complete()

    # ----------------------------------------------------------------------------------------- step

    @torch.no_grad()
    def _reduce(self) -> None:
        """Stages 0-1: the DP reduction of the accumulated gradients; then every stage: tied weights."""
        if self.group.size > 1 and self.stage == 0:
            for h in [comm.all_reduce(v, self.group, op="sum", async_op=True) for v in self._full_views]:
                h.wait()
        elif self.stage == 1:
            hs = [comm.reduce_scatter(self.space.slice(self.grad_shard, g), v, self.group, op="sum", async_op=True)
                  for g, v in enumerate(self._full_views)]
            for h in hs:
                h.wait()
        for g, group in self.tie_groups:
            target = self._full_views[g] if self.stage == 0 else self.space.slice(self.grad_shard, g)
            comm.all_reduce(target, group, op="sum")

    def _grad32(self) -> torch.Tensor:
        grad = self.full_grad if self.stage == 0 else self.grad_shard
        return grad if grad.dtype == self.master_dtype else grad.to(self.master_dtype)

    def _global_checks(self, grad: torch.Tensor):
        if self.scaler is None and self.clip_grad_norm is None:
            return False, None
        stats = torch.zeros(2, dtype=torch.float64, device=grad.device)
        if self.scaler is not None:
            stats[0] = float(DynamicLossScaler.local_overflow(grad))
        if self.clip_grad_norm is not None:
            if self._all_counted:
                stats[1] = grad.float().pow(2).sum()
            else:
                stats[1] = sum((grad[s:e].float().pow(2).sum() for s, e in self._runs),
                               torch.zeros((), device=grad.device))
        comm.all_reduce(stats, self.mesh.world_group, op="sum")
        found_inf = self.scaler is not None and float(stats[0]) > 0
        return found_inf, (float(stats[1].sqrt()) if self.clip_grad_norm is not None else None)

    @torch.no_grad()
    def step(self) -> bool:
        """Reduce, check, update this rank's slice and refresh the compute weights; False when an fp16
        overflow skipped the step."""
        self._reduce()
        grad = self._grad32()
        found_inf, norm = self._global_checks(grad)
        if found_inf:
            self.scaler.update(True)
            self.zero_grad()
            return False
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        coef = inv_scale
        if norm is not None:
            norm *= inv_scale
            self.last_grad_norm = norm
            coef *= min(1.0, self.clip_grad_norm / (norm + 1e-6))
        if coef != 1.0:
            grad.mul_(coef)
        out = self._param_out()
        self.updater.push_grad(grad)
        self.updater.step(out)
        self.updater.wait()
        self._publish(out)
        if self.scaler is not None:
            self.scaler.update(False)
        return True

    def _param_out(self) -> torch.Tensor:
        if self.params_in_master:
            return self.updater.master
        if self.stage == 0:
            return self.compute
        if self.compute_dtype == self.master_dtype and isinstance(self.updater, DeviceUpdater):
            return self.updater.master
        return self.space.new(self.compute_dtype, self.device, zero=False)

    @torch.no_grad()
    def _publish(self, out: torch.Tensor) -> None:
        """Stages 1-2: all-gather every group's new slice into the full compute weights (stage 0 wrote
        them in place)."""
        if self.stage == 0:
            return
        hs = [comm.all_gather(flat, self.space.slice(out, g), self.group, async_op=True)
              for g, flat in enumerate(self.flats)]
        for h in hs:
            h.wait()

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Rebuild the compute weights from the master (after a checkpoint load)."""
        master = self.updater.master
        if self.params_in_master:
            return
        if self.stage == 0:
            self.compute.copy_(master)
            return
        out = master.to(device=self.device, dtype=self.compute_dtype)
        self._publish(out)

    @torch.no_grad()
    def zero_grad(self) -> None:
        if self.full_grad is not None:
            self.full_grad.zero_()
            self._attach_grads()
        if self.grad_shard is not None:
            self.grad_shard.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
