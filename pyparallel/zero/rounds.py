"""The engine's gradient reduction during backward: each parameter's hook puts its gradient in its flat
group, and *rounds* launch the groups' reductions in one fixed order, so every data-parallel rank issues
the same collectives in the same sequence (ZeRO section 5.2: reduce-scatter overlapped with backward).

A round is one accumulation of every parameter: one autograd backward (a micro-batch), or under a
zero-bubble pipeline one W pass of one (chunk, micro-batch); with several chunks per rank, a round
reduces only its chunk's groups, at its place in the pipeline's action list. Stage 1 and 3 keep the full
gradient and launch per bucket during backward only with ``overlap`` (else at the step); stage 2 keeps
only the bucket being filled and launches it as soon as it is complete. Why rounds are cut this way is in
``_queue_end_round``.

A mixin of :class:`pyparallel.zero.engine.ShardEngine`: it reads the engine's layouts, gradient views,
buckets and reducer, which the engine builds.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class ReductionRounds:
    """Backward hooks and reduction rounds of :class:`~pyparallel.zero.engine.ShardEngine`."""

    def _on_grad(self, p: nn.Parameter) -> None:
        g, i = self._where[id(p)]
        if self.full_grad is not None:
            view = self._grad_views[g][i]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.add_(p.grad)
                p.grad = view if view.dtype == p.dtype else None
            self._pending_full = True
            if not (self.stage in (1, 3) and self.cfg.overlap and self.sync):
                return
        else:  # stage 2: into the bucket being filled, in the reduce dtype; the full gradient goes
            lay = self.layouts[g]
            if self._live[g] is None:
                self._live[g] = torch.zeros(lay.padded, dtype=self.reduce_dtype, device=self.device)
            o, n = lay.offsets[i], lay.numels[i]
            self._live[g][o:o + n].add_(p.grad.reshape(-1))
            p.grad = None
        opened = not self._round
        if opened:
            self._open_round()
        self._ready[g][i] = True
        self._launch_ready()
        if opened:
            self._queue_end_round()

    def _open_round(self) -> None:
        """A reduction round starts (its first gradient is in). Which flat groups it reduces: all of them,
        or, with several pipeline chunks per rank (``rounds``), those of the chunk whose backward or W this
        is (``split.running_chunk``): its own buckets and the shared buckets it is the designated reducer
        of (``combined.buckets.round_plan``); a gradient into another group stays in that group's bucket for
        that group's next round. Every round of a chunk reduces the same groups in the same order.

        When it runs ahead of its place in the action list (an early W, ``split.queue_in_place``), the
        reduce-scatters are issued at that place instead: early W's run while a stage waits for a message,
        so in an order across chunks that differs between DP replicas, but the list is the same on every
        replica, and so is the sequence of collectives issued at its places. Until then the gradients
        stay in the buckets, where a later W of the same chunk adds its own (one sum, sent by the first of
        the rounds to reach its place; the later ones send what has come in since)."""
        from pyparallel.pipeline_parallel import split  # lazily: nothing else here needs the pipeline package

        self._round, self._next = True, 0
        self._ready = [[False] * len(lay.params) for lay in self.layouts]
        self._order, self._deferred = list(range(len(self.layouts))), False
        if self.rounds is not None:
            chunk = split.running_chunk()
            if chunk not in self.rounds:
                raise RuntimeError(f"a gradient of a chunk that has no reduction round on this rank (chunk "
                                   f"{chunk}; rounds for chunks {sorted(self.rounds)}): ZeRO-2 with several "
                                   f"chunks per rank reduces only inside the pipeline's backward and W passes")
            order = self._order = self.rounds[chunk]
            self._deferred = split.queue_in_place(lambda: self._launch_round(order))

    def _queue_end_round(self) -> None:
        """Arrange for the round just opened to end once every gradient of its backward is in.

        A round is one accumulation of each parameter: ``_launch_ready`` launches a bucket once and moves
        on, so a second gradient into a launched bucket within a round would be lost. Normally the round is
        one autograd backward (one micro-batch) and ends in autograd's final callback. A zero-bubble W
        (``pipeline_parallel.split``) is one autograd call per weight group plus accumulations outside
        autograd (the "direct W", where autograd's ``queue_callback`` raises), so there the round is the
        whole W of one (chunk, micro-batch) and ends when the W does (``split.queue_callback``); ending it at
        each autograd call would reduce-scatter every bucket once per weight group.

        Why not the alternatives: deferring to the step as stages 1/3 do needs the full gradient, which
        stage 2 does not keep (that memory is what it saves); ending a round when its buckets are complete
        does not work either, since early W's (run while a stage waits for a message) come in an order that
        differs between DP replicas. With one round per W or backward, the rounds per step are fixed by the
        schedule, and all DP ranks issue the same collectives whatever order their W's ran in: with one chunk
        per rank every round reduces every group; with several, a round reduces its chunk's groups and an
        early W's reduce-scatters wait for its place in the list (``_open_round``). A gradient accumulated
        outside any backward and any W (an ``AccumulateGrad`` node called by hand) is a round of its own,
        ended now."""
        from pyparallel.pipeline_parallel import split  # lazily: nothing else here needs the pipeline package

        if split.queue_callback(self._end_round):
            return
        if torch._C._current_graph_task_id() != -1:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_round)
            return
        self._end_round()

    def _launch_ready(self) -> None:
        # Strictly in the round's group order, so every rank issues the same sequence of collectives.
        if self._deferred:
            return
        order = self._order
        while self._next < len(order) and all(self._ready[order[self._next]]):
            self._launch(order[self._next])
            self._next += 1

    def _launch_round(self, order: list[int]) -> None:
        """A deferred round's reduce-scatters, at its place in the pipeline's action list."""
        for g in order:
            self._launch(g)
        self.reducer.drain()

    def _launch(self, g: int) -> None:
        target = self.space.slice(self.grad_shard, g)
        if self.full_grad is not None:  # stages 1/3: this bucket's accumulated sum, overwriting the shard
            full = self._full_views[g]
            cast = full.dtype != self.reduce_dtype
            self.reducer.launch(full.to(self.reduce_dtype) if cast else full, target, accumulate=False, scratch=cast)
            return
        full = self._live[g]
        if full is None:  # no gradient reached this group on this rank: contribute zeros
            full = torch.zeros(self.layouts[g].padded, dtype=self.reduce_dtype, device=self.device)
        self._live[g] = None
        accumulate, self._clean[g] = not self._clean[g], False
        self.reducer.launch(full, target, accumulate=accumulate, scratch=True)

    def _end_round(self) -> None:
        """End of backward: launch what is left (parameters without a gradient count as zero), wait."""
        self._round = False
        if self._deferred:  # issued at the W's place in the list (_open_round)
            return
        for ready in self._ready:
            ready[:] = [True] * len(ready)
        self._launch_ready()
        self.reducer.drain()
        if self.full_grad is not None and self.stage >= 1 and self.cfg.overlap and self.sync:
            self._pending_full = False
