"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020, sections 5.1-5.2): optimizer state (P_os) and, in stage 2,
gradients (P_os+g) partitioned over the data-parallel ranks; every rank keeps whole compute weights.

Layout. Trainable parameters are grouped into buckets (``bucket_cap_mb``, filled from the last parameter,
so the first bucket's gradients are ready first) and each bucket's parameters become views of one flat
compute-dtype buffer, padded to a multiple of N. Rank r owns slice r of every bucket; its fp32 master and
optimizer state cover only those slices (one contiguous shard space, see ``flat_param``). Frozen
parameters stay out of the buckets and are simply replicated.

Step. Gradients are averaged with one reduce-scatter per bucket (rank r receives slice r), the rank updates
its slices, and one all-gather per bucket hands the new compute weights to every rank: 2Ψ elements per
rank per step, the same volume as DDP's all-reduce (ZeRO section 7).

Stage 1 keeps full gradients: parameters' ``.grad`` are views of persistent per-bucket buffers (2Ψ bytes in
bf16), as in DDP. Gradient accumulation is local and free: inside ``model.no_sync()`` nothing is
communicated, and the first backward outside it (or ``optimizer.step()``) reduce-scatters the sum.

Stage 2 keeps no full gradients. Each parameter's gradient is copied into its bucket (in the reduce dtype)
as soon as autograd accumulates it and ``.grad`` is dropped; a complete bucket is reduce-scattered
asynchronously while backward continues, added into this rank's gradient shard and freed, with at most a
few buckets alive at once. Gradient accumulation therefore costs one reduce-scatter per micro-batch
(``no_sync`` cannot defer it without keeping the full gradients that stage 2 exists to drop); the shard is
the only gradient memory (Ψ/N elements in the reduce dtype).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pyparallel import comm
from pyparallel.amp import MixedPrecision
from pyparallel.data_parallel.bucket import Bucket
from pyparallel.zero.flat_param import ShardSpace, plan_buckets
from pyparallel.zero.reduce import ShardReducer, shares_storage
from pyparallel.zero.step import DeviceUpdater


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


class Stage12Engine:
    """Buckets, hooks and shard bookkeeping for ZeRO stages 1 and 2 (see the module docstring)."""

    def __init__(self, module: nn.Module, group: comm.Group, stage: int, policy: MixedPrecision,
                 bucket_cap_bytes: int, device: torch.device, module_dtype: torch.dtype):
        self.stage = stage
        self.group = group
        self.device = device
        self.sync = True
        self.compute_dtype = policy.compute_dtype(module_dtype)
        self.reduce_dtype = policy.reduce_dtype
        named = list(module.named_parameters())
        self.trainable = [(n, p) for n, p in named if p.requires_grad]
        self.frozen = [(n, p) for n, p in named if not p.requires_grad]
        elem = torch.empty((), dtype=self.compute_dtype).element_size()
        self.layouts = plan_buckets(self.trainable, bucket_cap_bytes, group.size, elem)
        self.space = ShardSpace(self.layouts, group.rank)
        self.master_init = self._build_master()
        self.has_master = policy.has_master(module_dtype)
        self.flat_params = self._bind_params()
        self.reducer = ShardReducer(group, max_inflight=2)
        self._init_grads()
        self._where = {id(p): (g, i) for g, lay in enumerate(self.layouts) for i, p in enumerate(lay.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in self.trainable]
        self._ready = [[False] * len(lay.params) for lay in self.layouts]
        self._round_active = False
        self._next_launch = 0
        self._dirty = False  # stage 1: local gradients accumulated but not yet reduced
        self.updater = None  # set by setup(): DeviceUpdater or OptimizerOffload

    # ----------------------------------------------------------------------------------- setup

    @torch.no_grad()
    def _build_master(self) -> torch.Tensor:
        """fp32 values of this rank's slices, taken from the (already broadcast) original weights."""
        master = self.space.new(torch.float32, self.device)
        for g, lay in enumerate(self.layouts):
            full = lay.flatten([p for p in lay.params], torch.float32, self.device)
            a, b = lay.shard_range(self.group.rank)
            self.space.slice(master, g).copy_(full[a:b])
        return master

    @torch.no_grad()
    def _bind_params(self) -> list[torch.Tensor]:
        """Move every trainable parameter into its bucket's flat compute-dtype buffer (``p.data`` becomes a
        view, so the module, tied weights included, sees the buffer that the all-gather refreshes)."""
        flats = []
        for lay in self.layouts:
            flat = lay.flatten(lay.params, self.compute_dtype, self.device)
            for p, view in zip(lay.params, lay.views(flat)):
                p.data = view
            flats.append(flat)
        for _, p in self.frozen:
            if p.dtype != self.compute_dtype and p.is_floating_point():
                p.data = p.data.to(self.compute_dtype)
        return flats

    def _init_grads(self) -> None:
        self.buckets: list[Bucket] = []
        if self.stage == 1:
            for g, lay in enumerate(self.layouts):
                buf = torch.zeros(lay.padded, dtype=self.compute_dtype, device=self.device)
                bucket = Bucket(g, list(lay.params), list(lay.names), buf)
                for i, p in enumerate(lay.params):
                    p.grad = bucket.views[i]
                self.buckets.append(bucket)
        # Stage 2: the gradient shard is the only gradient memory. Stage 1: the reduced shard only exists
        # from the first reduction of a step until zero_grad(); the full buckets keep the local sums, so a
        # second synchronised backward before the step reduces the whole accumulation again, correctly.
        self.grad_shard = self.space.new(self.reduce_dtype, self.device) if self.stage == 2 else None
        self._clean = [True] * len(self.layouts)
        self._live: list[torch.Tensor | None] = [None] * len(self.layouts)  # stage 2 buckets being filled

    # ----------------------------------------------------------------------------- forward / hooks

    def run_forward(self, module: nn.Module, args, kwargs):
        return module(*args, **kwargs)

    def _on_grad(self, param: nn.Parameter) -> None:
        g, i = self._where[id(param)]
        if self.stage == 1:
            self.buckets[g].adopt_grad(i)
            self._dirty = True
            if not self.sync:
                return
        else:
            self._stash_grad(g, i, param)
        if not self._round_active:
            self._start_round()
        self._ready[g][i] = True
        self._launch_in_order()

    def _stash_grad(self, g: int, i: int, param: nn.Parameter) -> None:
        """Stage 2: copy the fresh gradient into the bucket (in the reduce dtype) and drop ``.grad``."""
        lay = self.layouts[g]
        if self._live[g] is None:
            self._live[g] = torch.zeros(lay.padded, dtype=self.reduce_dtype, device=self.device)
        o, n = lay.offsets[i], lay.params[i].numel()
        self._live[g][o : o + n].copy_(param.grad.reshape(-1))
        param.grad = None

    def _start_round(self) -> None:
        self._round_active = True
        self._next_launch = 0
        self._ready = [[False] * len(lay.params) for lay in self.layouts]
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_round)

    def _launch_in_order(self) -> None:
        # Strictly in bucket order, so every rank issues the same sequence of collectives.
        while self._next_launch < len(self.layouts) and all(self._ready[self._next_launch]):
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, g: int) -> None:
        if self.stage == 1:
            if self.grad_shard is None:
                self.grad_shard = self.space.new(self.reduce_dtype, self.device, zero=False)
            full = self.buckets[g].buffer
            cast = full.dtype != self.reduce_dtype
            if cast:
                full = full.to(self.reduce_dtype)  # a transient copy of one bucket: scratch
            self.reducer.launch(full, self.space.slice(self.grad_shard, g), accumulate=False, scratch=cast)
            return
        full = self._live[g]
        if full is None:  # no gradient reached this bucket on this rank: contribute zeros
            full = torch.zeros(self.layouts[g].padded, dtype=self.reduce_dtype, device=self.device)
        self._live[g] = None
        accumulate = not self._clean[g]
        self._clean[g] = False
        self.reducer.launch(full, self.space.slice(self.grad_shard, g), accumulate=accumulate, scratch=True)

    def _finish_round(self) -> None:
        """End of backward: launch what is left (parameters without a gradient count as zero), wait."""
        self._round_active = False
        for ready in self._ready:
            ready[:] = [True] * len(ready)
        self._launch_in_order()
        self.reducer.drain()
        self._dirty = False

    master_is_param_shard = False  # stages 1-2 keep whole weights; the master is always its own tensor

    def attach_updater(self, updater) -> None:
        self.updater = updater

    # ------------------------------------------------------------------------ optimizer interface

    def finish_reductions(self) -> None:
        """Before a step: stage 1 reduces gradients that were only accumulated under ``no_sync``."""
        if self.stage == 1 and self._dirty:
            for g in range(len(self.layouts)):
                self._launch(g)
            self.reducer.drain()
            self._dirty = False

    def step_grad(self) -> torch.Tensor:
        """This rank's averaged gradient as one fp32 shard-space tensor (itself when already fp32)."""
        if self.grad_shard is None:  # stage 1 and no gradient since the last zero_grad()
            self.grad_shard = self.space.new(self.reduce_dtype, self.device)
        return self.grad_shard if self.grad_shard.dtype == torch.float32 else self.grad_shard.float()

    def param_out(self) -> torch.Tensor:
        """Where the updater writes the new weights: the master itself in plain fp32 on the device, else a
        transient compute-dtype shard that the all-gathers read."""
        if self._out_is_master():
            return self.updater.master
        return self.space.new(self.compute_dtype, self.device, zero=False)

    def _out_is_master(self) -> bool:
        # Only the in-device updater: an offloaded master must be copied back to the device anyway.
        return self.compute_dtype == torch.float32 and isinstance(self.updater, DeviceUpdater)

    @torch.no_grad()
    def publish(self, out: torch.Tensor) -> None:
        handles = [comm.all_gather(flat, self.space.slice(out, g), self.group, async_op=True)
                   for g, flat in enumerate(self.flat_params)]
        for h in handles:
            h.wait()

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Give every rank compute weights equal to the masters (after loading a checkpoint)."""
        out = self.param_out()
        if not shares_storage(out, self.updater.master):
            out.copy_(self.updater.master)
        self.publish(out)

    @torch.no_grad()
    def zero_grad(self) -> None:
        if self.stage == 1:
            for bucket in self.buckets:
                bucket.buffer.zero_()
                for i, p in enumerate(bucket.params):
                    p.grad = bucket.views[i]
            self.grad_shard = None  # freed until the next reduction
        else:
            self.grad_shard.zero_()
        self._clean = [True] * len(self.layouts)
        self._dirty = False

    # ------------------------------------------------------------------------------------ report

    def memory_parts(self) -> tuple[dict, dict, int]:
        """(states, buffers, padding elements): this rank's parameter and gradient bytes, the peak sizes of
        its transient buffers, and how many padding elements the flat groups add over all ranks."""
        S, cd, rd = self.space.numel, self.compute_dtype, self.reduce_dtype
        padded = sum(lay.padded for lay in self.layouts)
        biggest = max((lay.padded for lay in self.layouts), default=0)
        frozen = sum(p.numel() * p.element_size() for _, p in self.frozen)
        # Stage 1's gradients are the full buckets; stage 2's the shard.
        grads = _nbytes(padded, cd) if self.stage == 1 else _nbytes(S, rd)
        states = {"params": _nbytes(padded, cd) + frozen, "grads": grads}
        buffers = {}
        inflight = self.reducer.max_inflight
        if self.stage == 1:
            buffers["reduced_grad_shard"] = _nbytes(S, rd)  # from the reduction to zero_grad()
            if rd != cd:
                buffers["reduce_cast_buckets"] = inflight * _nbytes(biggest, rd)
        else:
            buffers["grad_buckets"] = (inflight + 1) * _nbytes(biggest, rd)
        if rd != torch.float32:
            buffers["step_grad_fp32"] = _nbytes(S, torch.float32)
        if not self._out_is_master():
            buffers["step_param_out"] = _nbytes(S, cd)
        return states, buffers, padded - sum(lay.numel for lay in self.layouts)
