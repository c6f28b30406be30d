"""The one sharded data-parallel engine: ZeRO stages 0-3 (Rajbhandari et al. 2020) as policies over flat
groups, used by ``pyparallel.zero.setup`` and by ``pyparallel.parallelize`` (one pipeline stage's, tensor-
parallel or not, parameters over the data-parallel group).

Layout. A rank's trainable parameters are laid end to end in *flat groups* (``flat_param``): gradient
buckets for stages 0-2 (and stage 3 under a pipeline), wrapped units for stage 3 under ``zero.setup``; a
weight tied across pipeline stages gets a group of its own. Each group is padded to a multiple of the DP
degree N and rank r owns slice r (stage 0: N = 1 in the index arithmetic, the rank owns everything). The
rank's master weights, gradient shard and optimizer state cover only its slices, as *runs* of the user's
parameter groups (``groups``).

Stages (what a rank keeps between steps; the paper's P_os, P_os+g, P_os+g+p):

* 0: full weights, full gradients, full optimizer state; gradients all-reduced at the step.
* 1: full weights and gradients; gradients reduce-scattered (during backward, bucket by bucket, outside
  ``no_sync``; at the step otherwise), the rank's slices updated, weights all-gathered.
* 2: full weights; each bucket's gradients are reduce-scattered as soon as they are complete and only
  the rank's gradient shard is kept.
* 3: only the shards. Under ``zero.setup`` each unit is gathered around its forward and its backward and
  freed in between (``stage3.UnitGatherer``). Under a pipeline (``gather_per_step``) every flat group is
  gathered once when the step's first micro-batch starts and freed after the optimizer step, gradients are
  accumulated over the micro-batches and reduce-scattered once: what torchtitan does for PP + FSDP, so
  traffic stays one all-gather and one reduce-scatter of the stage's weights per step instead of m of each.

Reduction policy: ``reduce_op="avg"`` (``zero.setup``: the user's loss is a per-rank mean, as in DDP) or
``"sum"`` (``parallelize``: the pipeline pre-scales each micro-batch's loss by its share of the global
tokens). A weight tied across stages is then summed over the T stages holding it, on its group's slice
(Megatron-LM's embedding all-reduce, done on 1/N of the tensor) -- as a reduce-scatter: each stage keeps
the sum of one T-th of the slice (``FlatLayout.split``, ``owned_range``), holds master and optimizer state
for that part only and updates it, and an all-gather among the stages completes the slice again. Megatron
keeps the whole embedding's optimizer state on both its first and last stage; the traffic is the same (a
reduce-scatter and an all-gather are one all-reduce), the tied matrix's optimizer state is 1/T of it, and
the update is not computed T times. This holds for every stage, 0 included.

The step's global checks are one all-reduce over ``check_group`` of (overflow flag, squared gradient norm
per user group): every element counted exactly once (``ParamInfo.counted``: a tensor replicated over TP
counts on TP rank 0, a tied copy on its first stage, a stage-0 replica on DP rank 0), so clipping equals
``clip_grad_norm_`` on the unparallelised model, every rank skips the same fp16 overflow steps, and a
non-finite gradient is caught before it reaches a weight (``nonfinite``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyparallel import comm, materialize
from pyparallel.amp import DynamicLossScaler
from pyparallel.zero import groups as groups_mod
from pyparallel.zero.flat_param import FlatLayout, ShardSpace, alloc_storage, free_storage
from pyparallel.zero.reduce import ShardReducer
from pyparallel.zero.rounds import ReductionRounds
from pyparallel.zero.updater import DeviceUpdater

NONFINITE = ("raise", "skip", "ignore")


class NonFiniteGradientError(FloatingPointError):
    """A step whose gradients hold inf or NaN, with ``nonfinite="raise"``."""


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


@dataclass
class EngineConfig:
    """The policies of one engine (see the module docstring)."""

    stage: int
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32
    accum_dtype: torch.dtype | None = None  # full-gradient buffers (stages 0/1/3-per-step); None: compute dtype
    reduce_op: str = "avg"
    overlap: bool = True  # stages 1 and 3-per-step: reduce-scatter in backward, bucket by bucket (when ``sync``)
    gather_per_step: bool = False  # stage 3 under a pipeline
    offload: bool = False
    fuse: bool = True
    clip_grad_norm: float | None = None
    nonfinite: str = "raise"


class ShardEngine(ReductionRounds):
    """Flat groups, gradient reduction and the sharded optimizer step (see the module docstring).

    ``named``: [(ParamInfo, parameter)] of this rank; ``layouts``: its trainable parameters' flat groups
    (already padded for the DP degree); ``options`` / ``group_of``: the user's parameter groups
    (``groups.resolve``); ``optimizer_cls`` / ``defaults``: the element-wise optimizer and its arguments.
    ``rounds``: stage 2 under a pipeline with several chunks per rank: pipeline chunk -> the flat groups
    (in order) that a reduction round of that chunk reduces (``_open_round``); None: every round reduces
    every group. The reduction during backward (hooks, rounds, launches):
    :class:`~pyparallel.zero.rounds.ReductionRounds`.
    """

    def __init__(self, named, layouts: list[FlatLayout], cfg: EngineConfig, *, group: comm.Group,
                 check_group: comm.Group, device: torch.device, optimizer_cls, defaults: dict,
                 options: list[dict], group_of: dict[str, int], tie_groups=(), dp_owner: bool = True,
                 scaler: DynamicLossScaler | None = None, per_unit: bool = False,
                 rounds: dict[int, list[int]] | None = None):
        if cfg.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE)}; got {cfg.nonfinite!r}")
        self.cfg, self.stage, self.group, self.check_group, self.device = cfg, cfg.stage, group, check_group, device
        self.compute_dtype, self.reduce_dtype, self.master_dtype = cfg.compute_dtype, cfg.reduce_dtype, cfg.master_dtype
        self.accum_dtype = cfg.accum_dtype or cfg.compute_dtype
        self.scaler, self.clip_grad_norm = scaler, cfg.clip_grad_norm
        self.infos = {id(p): info for info, p in named}
        self.frozen = [(info, p) for info, p in named if not p.requires_grad]
        self.layouts = layouts
        self.rank = group.rank if self.stage >= 1 else 0
        self.space = ShardSpace(layouts, self.rank)
        self.tie_groups = list(tie_groups)  # [(flat group index, comm.Group of the stages holding it)]
        # A tied group's slice is shared by its stages: this one updates part ``group.rank`` of it.
        self.tie_parts = {g: tg.rank for g, tg in self.tie_groups}
        for g, tg in self.tie_groups:
            if layouts[g].split != tg.size:
                raise ValueError(f"flat group {g} ({layouts[g].names[0]}) is tied across {tg.size} stages, so its "
                                 f"layout must be split {tg.size} ways (FlatLayout(split=...)); it is split "
                                 f"{layouts[g].split}")
        self.dp_owner = dp_owner or self.stage >= 1
        self.per_unit = per_unit  # stage 3 with a UnitGatherer binding the parameters
        self.rounds = rounds
        if rounds is not None:
            covered = sorted(g for order in rounds.values() for g in order)
            if covered != list(range(len(layouts))):
                raise ValueError(f"rounds must name every flat group exactly once, got {rounds}")
        self.sync = True
        self.steps = 0
        self.last_grad_norm: float | None = None
        self.gatherer = None
        self._where = {id(p): (g, i) for g, lay in enumerate(layouts) for i, p in enumerate(lay.params)}
        self.n_groups = len(options)
        self.runs = groups_mod.plan_runs(layouts, self.rank, group_of, self.n_groups, self.tie_parts)
        self._counted = self._counted_ranges()
        self.reducer = ShardReducer(group, max_inflight=2, op=cfg.reduce_op)
        self._build_weights()
        self.updater = self._make_updater(optimizer_cls, defaults, options)
        self._build_grads()
        trainable = [p for lay in layouts for p in lay.params]
        self._hooks = [] if per_unit else [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]

    # ------------------------------------------------------------------------------------------ setup

    @property
    def master_in_params(self) -> bool:
        """No separate master copy: the optimizer updates the weights the model computes with (or, in stage
        3, the shard the gathers read), which is exact when they already have the master's dtype."""
        return self.compute_dtype == self.master_dtype and not self.cfg.offload

    @torch.no_grad()
    def _build_weights(self) -> None:
        """Flat compute buffers whose views the parameters become (not for per-unit stage 3: the gatherer
        binds its own), and the master: either the weights themselves or a tensor of its own."""
        self.master = None  # a shard-space tensor when the master is not the weights themselves
        self._compute = None  # stage 0: the one buffer every flat group is a view of
        if self.stage == 3:  # one group's full copy at a time: the peak is one unit, never the model
            self.master = self.space.new(self.master_dtype, self.device)
            for g, lay in enumerate(self.layouts):
                if not any(p.is_meta for p in lay.params):  # meta: a loader fills the shards next
                    a, b = lay.shard_range(self.rank)
                    self.space.slice(self.master, g).copy_(lay.flatten(lay.params, self.master_dtype,
                                                                       self.device)[a:b])
            self.flats = [torch.empty(lay.padded, dtype=self.compute_dtype, device=self.device)
                          for lay in self.layouts] if self.cfg.gather_per_step else []
            full = []
        else:
            full = [lay.flatten(lay.params, self.master_dtype, self.device) for lay in self.layouts]
        if self.stage == 0:  # world 1: the shard space is the concatenation of the full groups
            whole = torch.cat(full) if len(full) > 1 else full[0]
            if not self.master_in_params:
                self.master = whole
            self._compute = whole if self.master is None else whole.to(self.compute_dtype)
            self.flats = list(self._compute.split([lay.padded for lay in self.layouts]))
        elif self.stage in (1, 2):
            if not self.master_in_params:
                self.master = self.space.new(self.master_dtype, self.device, zero=False)
                for g, lay in enumerate(self.layouts):
                    a, b = lay.shard_range(self.rank)
                    self.space.slice(self.master, g).copy_(full[g][a:b])
            self.flats = [f if f.dtype == self.compute_dtype else f.to(self.compute_dtype) for f in full]
        del full
        for lay, flat in zip(self.layouts, self.flats):
            for p, view in zip(lay.params, lay.views(flat)):
                materialize.bind(p, view)  # a meta parameter (weights loaded next) gets its storage here
        self.gathered = self.stage != 3
        if self.stage == 3:
            for flat in self.flats:
                free_storage(flat)
        for _, p in self.frozen:
            if p.is_floating_point() and p.dtype != self.compute_dtype:
                p.data = p.data.to(self.compute_dtype)

    def master_slice(self, g: int) -> torch.Tensor:
        """This rank's master elements of flat group ``g`` (on the device, or on the host when offloaded)."""
        if self.master is None:
            a, b = self.layouts[g].shard_range(self.rank)
            return self.flats[g][a:b]
        return self.space.slice(self.master, g)

    def _run_ranges(self) -> list[tuple[int, int]]:
        return [(self.space.offsets[r.g] + r.lo, self.space.offsets[r.g] + r.hi) for r in self.runs]

    def _make_updater(self, optimizer_cls, defaults: dict, options: list[dict]):
        runs = self.runs

        def factory(params):
            by_group = [[] for _ in options]
            for run, p in zip(runs, params):
                by_group[run.k].append(p)
            return optimizer_cls([{"params": ps, **opts} for ps, opts in zip(by_group, options)], **defaults)

        ranges = self._run_ranges()
        if self.cfg.offload:
            from pyparallel.zero.offload import OptimizerOffload

            updater = OptimizerOffload(self.master, factory, self.device, ranges=ranges)
            self.master = updater.master  # the host copy is the master from here on
            self._at_rest = self.space.new(self.compute_dtype, self.device, zero=False) if self.stage == 3 else None
            if self._at_rest is not None:
                self._at_rest.copy_(updater.master)
            return updater
        masters = [self.master_slice(r.g)[r.lo:r.hi] for r in runs]
        fuse = self.cfg.fuse and self.master_dtype == torch.float32
        self._at_rest = self.master if self.stage == 3 and self.master_in_params else None
        return DeviceUpdater(masters, ranges, factory, self.device, fuse=fuse)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.updater.optimizer

    def _build_grads(self) -> None:
        self.full_grad = None
        self._full_views: list[torch.Tensor] = []
        self._grad_views: list[list[torch.Tensor]] = []
        full_grads = self.stage in (0, 1) or (self.stage == 3 and self.cfg.gather_per_step)
        if full_grads:
            total = sum(lay.padded for lay in self.layouts)
            self.full_grad = torch.zeros(total, dtype=self.accum_dtype, device=self.device)
            offset = 0
            for lay in self.layouts:
                view = self.full_grad[offset:offset + lay.padded]
                self._full_views.append(view)
                self._grad_views.append(lay.views(view))
                offset += lay.padded
            if self.stage == 3:
                free_storage(self.full_grad)
        self.grad_shard = self.space.new(self.reduce_dtype, self.device) if self.stage >= 1 else None
        self._attach_grads()
        self._live: list[torch.Tensor | None] = [None] * len(self.layouts)
        self._clean = [True] * len(self.layouts)
        self._ready = [[False] * len(lay.params) for lay in self.layouts]
        self._round, self._next = False, 0
        self._order = list(range(len(self.layouts)))  # the flat groups the current round reduces, in order
        self._deferred = False  # the current round's reduce-scatters wait for its place in the list
        self._pending_full = False  # stages 0/1/3-per-step: accumulated gradients not yet reduced

    def accumulating_params(self) -> set[int]:
        """ids of the parameters whose ``.grad`` is a view of a full-gradient buffer of their own dtype: a
        layer may add its weight gradient straight into it (``zero.accumulate``)."""
        if self.full_grad is None:
            return set()
        return {id(p) for lay, views in zip(self.layouts, self._grad_views)
                for p, v in zip(lay.params, views) if v.dtype == p.dtype}

    def _attach_grads(self) -> None:
        for lay, views in zip(self.layouts, self._grad_views):
            for p, v in zip(lay.params, views):
                p.grad = v if v.dtype == p.dtype else None  # autograd accumulates straight into the buffer

    def owned_range(self, g: int) -> tuple[int, int]:
        """The elements of flat group ``g`` (offsets in the full group) whose reduced gradient, master and
        optimizer state this rank holds: its slice, or, for a weight tied across stages, its part of it."""
        lay = self.layouts[g]
        return lay.owned_range(self.rank, self.tie_parts[g]) if g in self.tie_parts else lay.shard_range(self.rank)

    def _counted_ranges(self) -> list[tuple[int, int, int]]:
        """(user group, start, end) shard-space ranges whose squares enter the global gradient norm (the runs
        cover only the owned part of a tied group's slice, so each tied element counts on one stage)."""
        out = []
        for run in self.runs:
            lay = self.layouts[run.g]
            a, _ = lay.shard_range(self.rank)
            base = self.space.offsets[run.g]
            for p, o, n in zip(lay.params, lay.offsets, lay.numels):
                lo, hi = max(a + run.lo, o), min(a + run.hi, o + n)
                if lo < hi and self.dp_owner and self.infos[id(p)].counted:
                    s, e = base + lo - a, base + hi - a
                    if out and out[-1][0] == run.k and out[-1][2] == s:
                        out[-1] = (run.k, out[-1][1], e)
                    else:
                        out.append((run.k, s, e))
        return out

    # ---------------------------------------------------------------------------- stage 3 per step

    @torch.no_grad()
    def begin_step(self) -> None:
        """Stage 3 under a pipeline: gather every flat group (once per step) before the first micro-batch."""
        if not (self.stage == 3 and self.cfg.gather_per_step) or self.gathered:
            return
        handles = []
        for g, flat in enumerate(self.flats):
            alloc_storage(flat)
            handles.append(comm.all_gather(flat, self._rest_slice(g), self.group, async_op=True))
        alloc_storage(self.full_grad)
        self.full_grad.zero_()
        self._attach_grads()
        for h in handles:
            h.wait()
        self.gathered = True

    def _rest_slice(self, g: int) -> torch.Tensor:
        """What an all-gather of stage-3 group ``g`` reads: the at-rest compute-dtype shard, or a cast of the
        master (a transient copy of one slice)."""
        if self._at_rest is not None:
            return self.space.slice(self._at_rest, g)
        return self.master_slice(g).to(device=self.device, dtype=self.compute_dtype)

    def _end_step_gather(self) -> None:
        if self.stage == 3 and self.cfg.gather_per_step and self.gathered:
            for flat in self.flats:
                free_storage(flat)
            free_storage(self.full_grad)
            self.gathered = False

    # ------------------------------------------------------------------------------------------ step

    @torch.no_grad()
    def finish_reductions(self) -> None:
        """Before a step: whatever gradient reduction backward has not done yet, then tied weights."""
        if self.full_grad is not None and self._pending_full:
            if self.stage == 0:
                if self.group.size > 1:
                    for h in [comm.all_reduce(v, self.group, op=self.cfg.reduce_op, async_op=True)
                              for v in self._full_views]:
                        h.wait()
            else:
                for g in range(len(self.layouts)):
                    self._launch(g)
        self.reducer.drain()
        self._pending_full = False
        if self.rounds is not None and any(live is not None for live in self._live):
            left = [self.layouts[g].names[0] for g, live in enumerate(self._live) if live is not None]
            raise RuntimeError(f"ZeRO-2: gradients of flat groups starting at {left} were never reduce-scattered "
                               f"(no round of their designated chunk came after them this step)")
        for g, group in self.tie_groups:  # each stage keeps the sum of its part of the slice
            target = self._full_views[g] if self.stage == 0 else self.space.slice(self.grad_shard, g)
            comm.reduce_scatter_in_place(target, group, op="sum")
            a, b = self.owned_range(g)
            base = self.layouts[g].shard_range(self.rank)[0]
            target[:a - base].zero_()  # the other parts are undefined after the exchange: keep them zero
            target[b - base:].zero_()

    def _grad_master(self) -> torch.Tensor:
        """This rank's reduced gradient, shard space, in the master dtype (itself when it already is)."""
        grad = self.grad_shard
        if self.stage == 0:
            grad = self.full_grad
        if grad is None:
            grad = self.space.new(self.reduce_dtype, self.device)
        return grad if grad.dtype == self.master_dtype else grad.to(self.master_dtype)

    def _global_checks(self, grad: torch.Tensor):
        """One all-reduce of [overflow flag, squared norm of each user group]; (found_inf, per-group squares)."""
        need_norm = self.clip_grad_norm is not None or self.cfg.nonfinite != "ignore"
        if self.scaler is None and not need_norm:
            return False, None
        stats = torch.zeros(1 + self.n_groups, dtype=torch.float64, device=grad.device)
        if self.scaler is not None:
            stats[0] = float(DynamicLossScaler.local_overflow(grad))
        if need_norm:  # one dot product per counted range (no squared copy), summed in fp64
            for k, s, e in self._counted:
                part = grad[s:e]
                stats[1 + k] += torch.dot(part, part).double()
        comm.all_reduce(stats, self.check_group, op="sum")
        found_inf = self.scaler is not None and float(stats[0]) > 0
        return found_inf, (stats[1:].cpu() if need_norm else None)

    def _nonfinite(self, squares: torch.Tensor) -> bool:
        """Handle a non-finite gradient (``cfg.nonfinite``); True when the step must be skipped."""
        if self.cfg.nonfinite == "ignore" or bool(torch.isfinite(squares).all()):
            return False
        k = int((~torch.isfinite(squares)).nonzero()[0])
        if self.cfg.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"step {self.steps}: the gradient of parameter group {k} is not finite (its squared norm is "
                f"{float(squares[k])}); nothing was updated. Lower the learning rate, check the data, or pass "
                f"nonfinite='skip' to skip such steps (or 'ignore' to apply them)")
        return True

    @torch.no_grad()
    def step(self) -> bool:
        """Reduce, check, update this rank's elements and refresh the compute weights; False when the step
        was skipped (an fp16 overflow, or a non-finite gradient with ``nonfinite="skip"``)."""
        self.finish_reductions()
        grad = self._grad_master()
        found_inf, squares = self._global_checks(grad)
        skip = found_inf or (squares is not None and self.scaler is None and self._nonfinite(squares))
        if skip:
            if found_inf:
                self.scaler.update(True)
            self._end_step_gather()
            self.zero_grad()
            self.steps += 1
            return False
        inv_scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        coef = inv_scale
        if self.clip_grad_norm is not None:
            norm = float(squares.sum().sqrt()) * inv_scale
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
        self.steps += 1
        return True

    def _param_out(self) -> torch.Tensor | None:
        """Where the updater writes the new compute-dtype weights (None: into the masters only)."""
        if self.master is None:  # the masters are the weights (stage 0-2 in the compute dtype)
            return None
        if self.stage == 3:
            return self._at_rest if self._at_rest is not None and self.master is not self._at_rest else None
        if self.stage == 0:
            return self._compute
        return self.space.new(self.compute_dtype, self.device, zero=False)

    @torch.no_grad()
    def _publish(self, out: torch.Tensor | None) -> None:
        """Hand every rank the new weights: stages 1-2 all-gather each group's slice; stage 3 under a
        pipeline frees the gathered groups (the next step gathers the new shards); stage 0 wrote in place."""
        self._gather_tied(out)
        if self.stage == 3:
            self._end_step_gather()
            return
        if self.stage == 0:
            return
        handles = []
        for g, flat in enumerate(self.flats):
            if out is None:
                handles.append(comm.all_gather_in_place(flat, self.group, async_op=True))
            else:
                handles.append(comm.all_gather(flat, self.space.slice(out, g), self.group, async_op=True))
        for h in handles:
            h.wait()

    def _gather_tied(self, out: torch.Tensor | None) -> None:
        """Complete each tied group's slice of what the model computes with (or, in stage 3, of what the next
        gather reads) from the parts its stages updated; the master's other parts are left stale and are
        neither read nor saved (``pieces``)."""
        for g, group in self.tie_groups:
            if self.stage == 0:
                target = self.flats[g]
            elif self.stage == 3:
                target = self.space.slice(self._at_rest if self._at_rest is not None else self.master, g)
            elif out is None:
                a, b = self.layouts[g].shard_range(self.rank)
                target = self.flats[g][a:b]
            else:
                target = self.space.slice(out, g)
            comm.all_gather_in_place(target, group)

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Give every rank compute weights equal to the masters (after loading a checkpoint)."""
        if self.stage == 3:
            if self._at_rest is not None and self._at_rest is not self.master:
                self._at_rest.copy_(self.master)
            return
        if self.master is None:
            self._publish(None)
            return
        out = self._param_out()
        out.copy_(self.master)
        self._publish(out)

    @torch.no_grad()
    def zero_grad(self) -> None:
        if self.full_grad is not None and (self.stage != 3 or self.gathered):
            self.full_grad.zero_()
            self._attach_grads()
        if self.grad_shard is not None:
            self.grad_shard.zero_()
        self._clean = [True] * len(self.layouts)
        self._pending_full = False

    # ---------------------------------------------------------------------------------------- report

    def memory_parts(self) -> tuple[dict, dict, int]:
        """(states, buffers, padding elements): this rank's parameter and gradient bytes, the peak sizes of
        its transient buffers, and how many padding elements the flat groups add over all ranks."""
        if self.gatherer is not None:
            return self.gatherer.memory_parts()
        S, cd, rd = self.space.numel, self.compute_dtype, self.reduce_dtype
        padded = sum(lay.padded for lay in self.layouts)
        sizes = sorted((lay.padded for lay in self.layouts), reverse=True)
        inflight = self.reducer.max_inflight
        frozen = sum(p.numel() * p.element_size() for _, p in self.frozen)
        buffers = {}
        if self.stage == 3:  # per step: the gathered groups and full gradients live during the step only
            states = {"params": frozen + (_nbytes(S, cd) if self._at_rest is not None else 0),
                      "grads": _nbytes(S, rd)}
            buffers["gathered_weights"] = _nbytes(padded, cd)
            buffers["accumulated_grads"] = _nbytes(padded, self.accum_dtype)
        else:
            grads = _nbytes(padded, self.accum_dtype) if self.full_grad is not None else _nbytes(S, rd)
            states = {"params": _nbytes(padded, cd) + frozen, "grads": grads}
            if self.stage == 1:
                buffers["reduced_grad_shard"] = _nbytes(S, rd)
                if rd != self.accum_dtype:  # a cast copy of each bucket in flight
                    buffers["reduce_cast_buckets"] = _nbytes(sum(sizes[:inflight]), rd)
            elif self.stage == 2:
                # At most the reductions in flight plus the bucket being filled, and never more buckets than
                # there are: a model that fits in one bucket holds one bucket's gradient, not three.
                buffers["grad_buckets"] = _nbytes(sum(sizes[:inflight + 1]), rd)
        if self.stage >= 1 and rd != self.master_dtype:
            buffers["step_grad_master_dtype"] = _nbytes(S, self.master_dtype)
        if self.stage in (1, 2) and self.master is not None:
            buffers["step_param_out"] = _nbytes(S, cd)
        return states, buffers, padded - sum(lay.numel for lay in self.layouts)

    def master_bytes(self) -> int:
        """Bytes of a separate master copy on the device (0 when the master is the weights or offloaded)."""
        if self.master is None or self.cfg.offload or self.master is self._at_rest:
            return 0
        return self.space.numel * self.master.element_size()
