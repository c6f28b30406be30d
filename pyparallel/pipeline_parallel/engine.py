"""``PipelineParallel``: a model split over the mesh's pipeline axis, trained one step at a time.

    pipe = PipelineParallel(model, mesh, schedule="1f1b", num_microbatches=8)
    opt = torch.optim.AdamW(pipe.parameters())        # this rank's chunk(s) only
    loss = pipe.step(inputs, targets); opt.step(); opt.zero_grad()

``step`` splits the batch into ``m`` micro-batches, runs the schedule's action list (``schedules.py``)
with point-to-point traffic derived from it (``p2p.py``), and leaves gradients ready for any optimizer:

* **Loss scaling.** Micro-batch ``i``'s loss (a mean over its ``n_i`` target tokens) is multiplied by
  ``n_i / N`` before backward, where ``N`` counts target tokens over all micro-batches and all
  data-parallel replicas. Gradients are *summed* over micro-batches (and over the DP group, see below),
  so they are the gradients of the mean loss over the whole global batch, and ``step`` returns that mean.
* **Tied weights.** A parameter held by chunks on different stages (the GPT's ``wte`` / ``lm_head``)
  has its gradient all-reduced (summed) among those stages, in a group of just them, before ``step``
  returns (Megatron-LM's embedding group, Shoeybi et al. 2019). The copies start identical (broadcast
  from the first stage at construction) and so stay identical under any deterministic optimizer.
* **Data parallel.** With ``dp > 1``, ``reduce_dp_grads=True`` sums gradients over the DP group.
  Pass ``False`` to leave them per-replica for an optimizer that reduces them itself (ZeRO's
  reduce-scatter) — which must then *sum*, not average, because the loss is already pre-scaled.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from pyparallel import _ops, collector, comm, materialize
from pyparallel.data.split import microbatches
from pyparallel.data.tokens import check_batch_tokens
from pyparallel.data_parallel.ddp import broadcast_tensors
from pyparallel.pipeline_parallel import partition, schedules
from pyparallel.pipeline_parallel.labels import check_attention_mask, labels_to_targets
from pyparallel.pipeline_parallel.p2p import Links
from pyparallel.pipeline_parallel.stage import Chunk, StageCompute, infer_shapes, meta_copy
from pyparallel.pipeline_parallel.stats import SavedTensorMeter, StageStats, StepRecord

_DP_BUCKET_BYTES = 25 * 2**20


class PipelineParallel:
    """Pipeline-parallel training over ``mesh.pp`` stages (Huang et al. 2019; Narayanan et al. 2021).

    ``model_or_blocks``: the built-in GPT, a Hugging Face causal LM, an ``nn.Sequential`` or a list of
    modules (one tensor in, one tensor out). Every rank passes the same, identically initialised model;
    each keeps only its chunks. ``schedule``: "gpipe", "1f1b", "interleaved" (with ``virtual_stages``
    >= 2 chunks per rank), or the zero-bubble "zb-h1" and "zbv" (two chunks per rank in a V; Qi et al.
    2023), whose backward runs as B (input gradient) then W (weight gradients, deferred into the
    bubbles; see ``split.py``). ``loss_fn(outputs, targets)`` returns the mean over ``count_fn(targets)``
    terms (default: token cross-entropy for language models, required otherwise). ``boundaries``: the
    ``p * v + 1`` block indices where chunks start (default: balanced by parameter count).

    A model built on the meta device (the built-in GPT or a Hugging Face causal LM) is split into chunks on
    meta, and each stage gives storage and values only to its own chunks' tensors: from ``weights`` (a
    safetensors file or Hugging Face folder, under the model's own names, e.g.
    ``model.layers.0.self_attn.q_proj.weight``; a weight tied across stages, the embedding and the LM head,
    is read by each stage holding it) or, without weights, from ``init(name, module)`` (default: the model's
    ``init_module``, else each module's ``reset_parameters()``) under ``materialize.seed_of(name)``, as
    ``pyparallel.materialize`` documents: the values of the same initialisation in one process. Keys and shapes
    are checked (ValueError naming the tensors) before any collective; meta buffers (rotary ``inv_freq``) are rebuilt.
    """

    def __init__(self, model_or_blocks, mesh, *, schedule: str = "1f1b", num_microbatches: int | None = None,
                 virtual_stages: int = 1, loss_fn=None, count_fn=None, boundaries=None,
                 activation_checkpointing: bool = False, reduce_dp_grads: bool = True,
                 track_activation_memory: bool = False, weights=None, init=None):
        reader, buffers = self._open_source(model_or_blocks, mesh, weights, init)  # before any collective
        blocks, default_loss = partition.to_blocks(model_or_blocks)
        # Conventions the model supports (see step): HF's unshifted labels for language models (the ones
        # with a token cross-entropy default), an attention mask for HF decoder layers.
        self.takes_labels = default_loss is partition.token_cross_entropy
        self.takes_attention_mask = any(getattr(b, "takes_attention_mask", False) for b in blocks)
        self.loss_fn = loss_fn or default_loss
        # What every stage checks the batch against (the embedding and the loss run on one stage each);
        # targets are token ids only for the model's own loss.
        ids, out, self._positions = partition.token_vocab(blocks)
        self._vocab = (ids, out if loss_fn is None else None)
        if self.loss_fn is None:
            raise ValueError(f"a {type(model_or_blocks).__name__} has no default loss: pass "
                             f"loss_fn(outputs, targets) returning the mean loss of a micro-batch")
        self.count_fn = count_fn or partition.default_count
        self.mesh, self.group = mesh, mesh.pp_group
        self.p, self.rank, self.schedule = mesh.pp, mesh.pp_rank, schedule
        schedules.check_schedule(schedule, self.p, virtual_stages)
        self.v = virtual_stages = schedules.chunks_per_stage(schedule, virtual_stages)
        if num_microbatches is not None:
            schedules.check_config(schedule, self.p, num_microbatches, virtual_stages)
        self.num_microbatches = num_microbatches
        self.split_backward = schedule in schedules.SPLIT_BACKWARD
        self.bounds = partition.plan_chunks(blocks, self.p, virtual_stages, boundaries)
        self.num_chunks = self.p * virtual_stages
        self.reduce_dp_grads = reduce_dp_grads
        self._meta_blocks = meta_copy(blocks)
        self.chunks = {c: Chunk(blocks[self.bounds[c]:self.bounds[c + 1]], c, self.bounds[c],
                                activation_checkpointing)
                       for c in range(self.num_chunks) if self.stage_of(c) == self.rank}
        self._p2p_groups = self._make_p2p_groups()
        self._tied = self._make_tied_groups(partition.tied_parameters(blocks, self.bounds, self.p, self.stage_of))
        if reader is not None:
            self._materialize(model_or_blocks, reader, buffers)
        for chunk in self.chunks.values():
            if not materialize.has_meta(chunk):  # tensors left on meta are given storage by their loader
                chunk.to(mesh.device)
        if reader is None:  # loaded stages and replicas all read the same values already
            self._sync_initial_weights()
        self._meter = SavedTensorMeter(exclude=self.parameters()) if track_activation_memory else None
        self._plans: dict[int, tuple] = {}
        self._shapes: dict[tuple, list | None] = {}
        self._stats = StageStats()
        self._last_m: int | None = None

    # ----------------------------------------------------------------------- meta models, weights

    @staticmethod
    def _open_source(model, mesh, weights, init):
        """The reader this stage's tensors come from (``materialize.open_source``) and the buffer names it
        fills; a block list has no model names to read weights under."""
        if isinstance(model, (list, tuple, nn.Sequential, nn.ModuleList)):
            if weights is not None or init is not None or any(
                    t.is_meta for b in model if isinstance(b, nn.Module) for t in [*b.parameters(), *b.buffers()]):
                raise ValueError("a block list or nn.Sequential cannot be built from weights= / init= nor left on "
                                 "the meta device: pass the built-in GPT or a Hugging Face causal LM (whose own "
                                 "parameter names the weights use), or blocks with real tensors")
            return None, set()
        reader = materialize.open_source(model, mesh.device, weights, init)
        return reader, materialize.loadable(model, reader)

    def _local_modules(self) -> set[int]:
        """ids of the modules this stage runs: its chunks' and those a block keeps unregistered (the rotary
        embedding an HF decoder layer shares)."""
        out = set()
        for chunk in self.chunks.values():
            for m in chunk.modules():
                out.add(id(m))
                out.update(id(x) for v in vars(m).values() if isinstance(v, nn.Module) for x in v.modules())
        return out

    def _materialize(self, model, reader, buffers) -> None:
        """Storage and values for this stage's tensors only (the other stages' stay on meta)."""
        materialize.rebuild_buffers(model, self.mesh.device, buffers, only=self._local_modules())
        materialize.load_in_place(self, reader, self.mesh.device)

    # --------------------------------------------------------------------------------- parameters

    def parameters(self):
        """This rank's parameters (each once), for the optimizer."""
        seen = set()
        for chunk in self.chunks.values():
            for prm in chunk.parameters():
                if id(prm) not in seen:
                    seen.add(id(prm))
                    yield prm

    def named_parameters(self):
        seen = set()
        for c, chunk in sorted(self.chunks.items()):
            for name, prm in chunk.named_parameters():
                if id(prm) not in seen:
                    seen.add(id(prm))
                    yield f"chunk{c}.{name}", prm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for chunk in self.chunks.values():
            chunk.zero_grad(set_to_none=set_to_none)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size under the unparallelised model's names, on every rank (a collective
        over the world; it moves the whole model: for small models, tests and exports)."""
        from pyparallel.checkpoint import gather_full, modules

        infos, *_ = modules.describe_model(self)
        mine = {"model/" + info.name for info, _ in infos}  # this rank's parameters (buffers left out)
        return gather_full([pc for pc in modules.module_pieces(self) if pc[0].name in mine], self.mesh.world_group)

    def train(self, mode: bool = True):
        for chunk in self.chunks.values():
            chunk.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.stage_of(self.num_chunks - 1)

    def stage_of(self, c: int) -> int:
        """The pipeline rank holding global chunk ``c`` (round robin; the V for "zbv")."""
        return schedules.stage_of(self.schedule, c, self.p)

    def _make_p2p_groups(self) -> dict[tuple[int, int], comm.Group]:
        """A two-rank group (sender first) per direction of every pair of stages that exchange messages,
        per (dp, tp) coordinate, created on every rank in one order (see ``p2p.py`` for why per
        direction). Then one small message through each, in the same global order on every rank, so
        that lazily initialised communicators (NCCL) are set up before any schedule depends on them."""
        mesh, edges = self.mesh, set()
        for c in range(self.num_chunks - 1):
            a, b = self.stage_of(c), self.stage_of(c + 1)
            if a != b:  # ZBV's turn (chunks p-1 and p on rank p-1) needs no message
                edges |= {(a, b), (b, a)}
        mine = {}
        for dp in range(mesh.dp):
            for tp in range(mesh.tp):
                for a, b in sorted(edges):
                    ranks = [mesh.rank_of(dp, tp, a), mesh.rank_of(dp, tp, b)]
                    g = comm.new_group(ranks, "pp", mesh.timeout_s, mesh.backend,
                                       label=f"stage {a} to stage {b}: global rank {ranks[0]} sends to "
                                             f"global rank {ranks[1]}")
                    if g is not None:
                        mine[(a, b)] = g
        ping = torch.zeros(1, device=mesh.device)
        for (a, _b), g in sorted(mine.items()):
            if a == self.rank:
                comm.send(ping, 1, g)
            else:
                comm.recv(ping, 0, g)
        return mine

    def _make_tied_groups(self, tied) -> list[tuple[nn.Parameter, comm.Group]]:
        """One group per set of stages sharing a weight, per (dp, tp) coordinate; created on every rank in
        the same order (``comm.new_group`` is a collective over the world)."""
        mesh, mine, groups = self.mesh, [], {}
        for stages in sorted({s for _, s, _ in tied}):
            for dp in range(mesh.dp):
                for tp in range(mesh.tp):
                    ranks = [mesh.rank_of(dp, tp, s) for s in stages]
                    g = comm.new_group(ranks, "pp_tied", mesh.timeout_s, mesh.backend)
                    if g is not None:
                        groups[stages] = g
        for _, stages, prm in tied:
            if self.rank in stages:
                mine.append((prm, groups[stages]))
        return mine

    def _sync_initial_weights(self) -> None:
        with torch.no_grad():
            for prm, group in self._tied:
                comm.broadcast(prm.data, 0, group)  # the first stage's copy wins
            if self.mesh.dp > 1:
                broadcast_tensors([t.data for t in self.parameters()], self.mesh.dp_group)

    # -------------------------------------------------------------------------------------- a step

    def step(self, inputs: torch.Tensor, targets: torch.Tensor | None = None, num_microbatches: int | None = None,
             *, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> float:
        """Forward and backward of one batch through the pipeline; returns the mean loss over the batch
        (and over the DP group), the same on every rank. Gradients accumulate into ``.grad`` (call the
        optimizer's ``zero_grad`` between steps). Every stage passes the same batch (the first stage reads
        the inputs, the last the targets, every stage the attention mask; all use the shapes to validate).

        Two label conventions (docs/pipeline.md, "Labels and padding"): ``targets`` aligned with the outputs (already
        shifted), or, for language models, Hugging Face's ``labels=`` (unshifted: the loss at position t
        is over token t + 1, -100 ignored). ``attention_mask=`` [batch, seq] (1 = token, 0 = padding)
        reaches every decoder layer of a Hugging Face causal LM, as in ``model(..., attention_mask=)``."""
        start = time.perf_counter()
        m = num_microbatches or self.num_microbatches
        targets = self._validate(inputs, targets, m, labels, attention_mask)
        return self._step(inputs, targets, m, attention_mask, start)

    def _step(self, inputs, targets, m, attention_mask, start) -> float:
        """``step`` once ``_validate`` has passed (``targets`` aligned with the outputs)."""
        self._last_m = m
        dev = self.mesh.device
        mb_inputs = microbatches(inputs.to(dev), m) if self.is_first else None
        mb_targets = microbatches(targets.to(dev), m) if self.is_last else None
        # Every stage slices the mask from its own copy of the batch: it is an input all ranks hold, so it
        # never travels between stages.
        mb_masks = microbatches(attention_mask.to(dev), m) if attention_mask is not None else None
        expected_shapes = self._infer(mb_shape(inputs, m), mb_shape(targets, m))
        scales = self._loss_scales(mb_targets) if self.is_last else None
        actions, expected = self._plan(m)
        compute = StageCompute(self.chunks, self.num_chunks, self.loss_fn, self._meter, self.split_backward)
        if self._meter is not None:
            self._meter.reset_peak()
        links = Links(self._p2p_groups, self.rank, expected, dev, expected_shapes)
        # A garbage collection due mid-schedule would stall every stage waiting on this one; it runs after
        # the step instead, when all have drained (collector.py).
        with collector.held():
            self._run(actions, compute, links, mb_inputs, mb_targets, scales, mb_masks)
            loss, flush_s = self._flush(compute.loss_sum)
            self._reduce_tied()
            if self.reduce_dp_grads and self.mesh.dp > 1:
                self._reduce_dp()
        self._stats.steps.append(StepRecord(
            busy_s=compute.busy_s, idle_s=links.wait_s + flush_s, wall_s=time.perf_counter() - start,
            peak_inflight=compute.peak_inflight,
            peak_activation_bytes=self._meter.peak if self._meter is not None else None,
            weight_s=compute.weight_s, microbatches=m, action_s=dict(compute.action_s), early_w=self._early_w,
            split=dict(compute.split_counts) if self.split_backward else None))
        return loss

    def _validate(self, inputs, targets, m, labels=None, attention_mask=None) -> torch.Tensor:
        """Identical on every rank (every rank sees the same shapes), so all raise together. Returns the
        targets aligned with the outputs (``labels`` shifted when given)."""
        if m is None:
            raise ValueError("pass num_microbatches to PipelineParallel(...) or to step(...)")
        schedules.check_config(self.schedule, self.p, m, self.v)
        if not isinstance(inputs, torch.Tensor):
            raise ValueError("step(inputs, targets) takes tensors, batch dimension first")
        targets = labels_to_targets(inputs, targets, labels, self.takes_labels)
        check_attention_mask(inputs, attention_mask, self.takes_attention_mask)
        if not isinstance(targets, torch.Tensor):
            raise ValueError("step(inputs, targets) takes two tensors, batch dimension first")
        if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"inputs of shape {tuple(inputs.shape)} and targets of shape "
                             f"{tuple(targets.shape)} must share the batch (first) dimension")
        if inputs.shape[0] % m:
            raise ValueError(f"the batch of {inputs.shape[0]} samples is not divisible by num_microbatches "
                             f"({m}); use a batch that is a multiple of {m}")
        self._check_tokens(inputs, targets, labels)
        return targets

    def _check_tokens(self, inputs, targets, labels) -> None:
        """A language model's ids, labels and length, on every stage: one process raises IndexError in the
        embedding or the loss, which here run on the first and the last stage only, and the other stages
        would wait for a message until the group's timeout."""
        if self._positions is not None and inputs.dim() >= 2 and inputs.shape[1] > self._positions:
            raise ValueError(f"a sequence of {inputs.shape[1]} tokens is longer than the model's "
                             f"{self._positions} learned positions; use sequences of at most {self._positions}")
        check_batch_tokens(inputs, targets, labels, *self._vocab)

    def _infer(self, x_shape, t_shape):
        key = (x_shape, t_shape)
        if key not in self._shapes:
            x = torch.empty(x_shape[0], dtype=x_shape[1], device="meta")
            t = torch.empty(t_shape[0], dtype=t_shape[1], device="meta")
            shapes = infer_shapes(self._meta_blocks, self.bounds, self.p, x, t, self.loss_fn, self.stage_of)
            self._shapes[key] = None if shapes is None else dict(enumerate(shapes))
        return self._shapes[key]

    def _loss_scales(self, mb_targets) -> list[float]:
        counts = torch.tensor([float(self.count_fn(t)) for t in mb_targets], dtype=torch.float64)
        total = counts.sum().reshape(1)
        if self.mesh.dp > 1:
            comm.all_reduce(total, self.mesh.dp_group)
        return (counts / total.clamp_min(1.0)).tolist()

    def _plan(self, m: int):
        if m not in self._plans:
            lists = [schedules.build(self.schedule, r, self.p, m, self.v) for r in range(self.p)]
            expected = {peer: schedules.messages_from(lists[peer], peer, self.rank, self.p, self.num_chunks,
                                                      self.schedule)
                        for peer in range(self.p) if peer != self.rank}
            self._plans[m] = (lists[self.rank], expected)
        return self._plans[m]

    def _run(self, actions, compute: StageCompute, links: Links, mb_inputs, mb_targets, scales,
             mb_masks=None) -> None:
        """Execute this rank's action list. Activations and gradients between chunks on the same rank (ZBV's
        turn) are handed over locally. Under a zero-bubble schedule, a stage about to block on a message
        that has not arrived first runs deferred W's whose B has run (which ones: below), so the weight
        gradients fill the wait; W sends nothing, so the message order (and hence
        every receive) is unchanged. What an early W queued for its own place in the list
        (``split.queue_in_place``: ZeRO-2's reduce-scatters) runs when the list reaches it, so collectives
        over the data-parallel group stay at the same points of the list on every replica.

        Which W's may go early: the first pending W of a chunk whose B has run, unless a chunk it shares a
        parameter with (ZBV's tied embedding and head, both on rank 0) has a W pending before it in the
        list — so each parameter sums its micro-batches in list order. A W behind another chunk's W
        that still waits for its B (the first chunk's, whose B is empty and comes when the gradient
        arrives) is not held up by it."""
        last, me = self.num_chunks - 1, self.rank
        local: dict[tuple, torch.Tensor] = {}
        pending = [a for a in actions if a.kind == "W"]  # list order
        shares = self._shared_chunks()
        early: set = set()
        in_place: dict = {}  # early W -> what it left to run at its place in the list (split.queue_in_place)
        self._early_w = 0

        def next_early():
            blocked: set = set()  # chunks with an earlier pending W (and the chunks tied to them)
            for a in pending:
                if a.chunk not in blocked and compute.has_weight(a.chunk, a.mb):
                    return a
                blocked |= shares[a.chunk]
            return None

        def receive(peer: int, key: tuple) -> torch.Tensor:
            while pending and not links.ready(peer, key):
                a = next_early()
                if a is None:
                    break
                pending.remove(a)
                in_place[a] = compute.weight(a.chunk, a.mb, early=True)
                early.add(a)
                self._early_w += 1
            return links.take(peer, key)

        for a in actions:
            c, i = a.chunk, a.mb
            if a.kind == "W":
                if a not in early:
                    pending.remove(a)
                    compute.weight(c, i)
                for fn in in_place.pop(a, ()):  # an early W's work that belongs at its place (ZeRO-2's round)
                    fn()
            elif a.kind == "F":
                if c == 0:
                    x = mb_inputs[i]
                elif self.stage_of(c - 1) == me:
                    y = local.pop(("act", c - 1, i))
                    x = y.detach().requires_grad_(y.requires_grad and y.is_floating_point())
                else:
                    x = receive(self.stage_of(c - 1), ("act", c - 1, i))
                    x.requires_grad_(links.act_meta[c - 1][2] and x.is_floating_point())
                mask = mb_masks[i] if mb_masks is not None else None
                if c == last:
                    compute.forward(c, i, x, mb_targets[i], scales[i], mask=mask)
                else:
                    y = compute.forward(c, i, x, mask=mask)
                    if self.stage_of(c + 1) == me:
                        local[("act", c, i)] = y
                    else:
                        links.send_act(c, y, self.stage_of(c + 1))
            else:
                grad = None
                if c != last and self.stage_of(c + 1) == me:
                    grad = local.pop(("grad", c, i), None)
                elif c != last and links.sent_meta[c][2]:
                    grad = receive(self.stage_of(c + 1), ("grad", c, i))
                gx = compute.backward(c, i, grad)
                if gx is not None:
                    if self.stage_of(c - 1) == me:
                        local[("grad", c - 1, i)] = gx
                    else:
                        links.send_grad(gx, self.stage_of(c - 1))
            links.progress()
        links.finish()

    def _shared_chunks(self) -> dict[int, set[int]]:
        """For each local chunk, itself and the local chunks holding one of its parameters."""
        ids = {c: {id(q) for q in ch.parameters()} for c, ch in self.chunks.items()}
        return {c: {d for d in ids if ids[c] & ids[d]} for c in ids}

    # --------------------------------------------------------------------------------- end of step

    def _flush(self, local_loss) -> tuple[float, float]:
        """All-reduce the loss over the pipeline group: the flush every stage waits in until the whole
        pipeline has drained (so its wait is bubble). Then sum over the DP replicas."""
        start = time.perf_counter()
        loss = torch.zeros(1, dtype=torch.float64, device=self.mesh.device)
        if self.is_last:
            loss += local_loss
        comm.all_reduce(loss, self.group)
        flush_s = time.perf_counter() - start
        if self.mesh.dp > 1:
            comm.all_reduce(loss, self.mesh.dp_group)
        return float(loss.item()), flush_s

    def _reduce_tied(self) -> None:
        for prm, group in self._tied:
            if prm.grad is None:
                prm.grad = torch.zeros_like(prm)
            comm.all_reduce(prm.grad, group, op="sum")

    @torch.no_grad()
    def _reduce_dp(self) -> None:
        """Sum gradients over the DP group in flat buckets of ~25 MB, all in flight at once."""
        params = [q for q in self.parameters() if q.requires_grad]
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        buckets, cur, size = [], [], 0
        for q in params:
            if cur and (q.dtype != cur[0].dtype or size + q.numel() * q.element_size() > _DP_BUCKET_BYTES):
                buckets.append(cur)
                cur, size = [], 0
            cur.append(q)
            size += q.numel() * q.element_size()
        if cur:
            buckets.append(cur)
        pending = []
        for b in buckets:
            flat = torch.empty(sum(q.numel() for q in b), dtype=b[0].dtype, device=b[0].device)
            _ops.flatten_into([q.grad for q in b], flat)
            pending.append((b, flat, comm.all_reduce(flat, self.mesh.dp_group, async_op=True)))
        for b, flat, handle in pending:
            handle.wait()
            _ops.unflatten_from(flat, [q.grad for q in b])

    # --------------------------------------------------------------------------------------- stats

    def reset_stats(self) -> None:
        self._stats = StageStats()

    def stats(self, local: bool = False) -> dict:
        """Measured bubble next to theory, peak in-flight micro-batches, over the steps since
        ``reset_stats()``. A collective over the pipeline group (every stage must call it) unless
        ``local=True``, which returns only this stage's numbers without communicating."""
        m = self._last_m or self.num_microbatches or self.p
        mine = {"stage": self.rank, **self._stats.summary(),
                "inflight_limit": schedules.inflight_limit(self.schedule, self.rank, self.p, m, self.v)}
        out = {"schedule": self.schedule, "p": self.p, "v": self.v, "m": m,
               "bubble_theory": schedules.theoretical_bubble(self.p, m, self.v, self.schedule),
               "backward_split": self.split_backward}
        if local:
            return {**out, **mine}
        stages = comm.all_gather_object(mine, self.group)
        measured = [s["bubble"] for s in stages if s.get("steps")]
        medians = [s["bubble_median_step"] for s in stages if s.get("steps")]
        out.update({
            "bubble_measured": sum(measured) / len(measured) if measured else None,
            "bubble_measured_median_step": sum(medians) / len(medians) if medians else None,
            "peak_inflight": [s.get("peak_inflight") for s in stages],
            "inflight_limit": [s["inflight_limit"] for s in stages],
            "peak_activation_bytes": [s.get("peak_activation_bytes") for s in stages],
            "split": [s.get("split") for s in stages],
            "bubble_simulated": self._simulated_bubble(stages, m),
            "stages": stages,
        })
        return out

    def _simulated_bubble(self, stages: list[dict], m: int) -> float | None:
        """The bubble of the schedule's lists played at each stage's measured time per micro-batch of each
        action (free messages): what this schedule leaves at these compute times, an uneven split
        included. None before every stage has timed a step."""
        if not all(s.get("steps") for s in stages):
            return None
        lists = [schedules.build(self.schedule, r, self.p, m, self.v) for r in range(self.p)]
        per_mb = [{k: t / s["microbatches"] for k, t in s["action_s"].items()} for s in stages]
        return schedules.play(lists, self.schedule, self.p,
                              lambda r, a: per_mb[r].get(f"{a.kind}{a.chunk}", 0.0))["bubble"]


def mb_shape(t: torch.Tensor, m: int) -> tuple[tuple, torch.dtype]:
    return (t.shape[0] // m, *t.shape[1:]), t.dtype
