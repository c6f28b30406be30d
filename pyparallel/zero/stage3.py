"""ZeRO stage 3 (Rajbhandari et al. 2020, section 5.3, P_os+g+p): parameters, gradients and optimizer state
all partitioned; a rank holds 16Ψ/N bytes of model state with mixed-precision Adam.

Each unit (see ``wrap``) keeps only this rank's flat shard: the fp32 master slice (cast to the compute dtype
by each gather; with the optimizer offloaded, a compute-dtype copy instead). Its life in one step:

1. Forward pre-hook: all-gather the unit (already in flight if it was prefetched) into a fresh full
   buffer, bind the module's parameter attributes to views of it, and start gathering the next unit of
   the forward order (learnt from the previous step), so communication overlaps this unit's compute.
   The views come out of :class:`_GatherFn`, whose backward is the unit's post-backward.
2. Forward post-hook: free the full buffer's storage (the tensor and its views stay alive: autograd saved
   them) and hook the unit's outputs.
3. Pre-backward (the first gradient reaching an output): refill the same storage by all-gathering again,
   and prefetch the unit that ran before it, which backward reaches next.
4. Post-backward (:class:`_GatherFn.backward`, run by autograd once every parameter view's gradient has
   been summed into one flat gradient): free the weights, reduce-scatter the gradient asynchronously into
   this rank's gradient shard, and let the full gradient go.

Per step each rank therefore moves two all-gathers and one reduce-scatter of every unit, 3Ψ (ZeRO
section 7.2.2), except the root unit and the last units of the forward (the last block and anything small
after it), whose weights stay gathered into the backward that starts with them. The root (the parameters
outside every unit: embeddings, final norm, tied head) is gathered once per step, before the forward, and
its weights go as soon as no tensor autograd saved reads them (:class:`_RootReaders`): after the head's
backward, before the embedding's adds a root-sized gradient of its own.

Gradient accumulation adds each micro-batch's reduce-scatter into the shard (one reduce-scatter per
micro-batch; ``no_sync`` does not defer it). Parameters may only be read inside their unit's forward (they
are freed outside it); the forward order must be the same on every rank. Frozen parameters are not
sharded: they stay whole and replicated.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from pyparallel import comm
from pyparallel.zero.flat_param import FlatLayout, alloc_storage, free_storage, storage_allocated
from pyparallel.zero.wrap import UnitSpec


class _Unit:
    def __init__(self, index: int, spec: UnitSpec, layout: FlatLayout):
        self.index = index
        self.spec = spec
        self.layout = layout
        self.shard_param: nn.Parameter | None = None
        self.prefetched: _Gathered | None = None
        self.active: list[_Gathered] = []  # records of forward calls in progress (nesting, reuse)


class _Gathered:
    """One materialisation of a unit: created per forward call, refilled for its backward."""

    def __init__(self, unit: _Unit, full: torch.Tensor, handle):
        self.unit = unit
        self.full = full
        self.handle = handle
        self.pass_: list[_Gathered] | None = None
        self.position = -1
        self.backward_done = False
        self.released = False  # (root) no saved tensor reads the weights any more: never refill them

    def wait(self) -> None:
        if self.handle is not None:
            handle, guard, _ = self.handle
            handle.wait()
            guard.__exit__(None, None, None)
            self.handle = None


class _RootReaders:
    """Counts the tensors autograd saved for backward that read the root unit's gathered weights.

    The root is gathered for the whole forward (its parameters are used anywhere: the embedding first, the
    tied LM head last) and its gradient only arrives at the end of backward, with the embedding's. Its
    weights, though, are needed in backward only by the operations that saved them (the head's matmul, a
    final norm); once autograd has released those saved tensors (it does after each node's backward, unless
    ``retain_graph``), the weights are dead and their storage goes, before the embedding's backward adds
    its own root-sized gradient. Saved tensors are seen through ``saved_tensors_hooks`` around the forward:
    one that reads the root's storage is packed into a :class:`_RootRead`, whose release is counted.

    Each saved tensor is packed detached: the pack hook receives the live tensor, and a saved *output* kept
    with its ``grad_fn`` would hold the node that holds it, a cycle in C++ that no garbage collection
    breaks, leaking the whole graph whenever it is dropped without a plain backward (``retain_graph``, or a
    forward never backpropagated); autograd restores the grad_fn on unpacking (pytorch/pytorch#189025).
    Hooks the user installed around the call (``save_on_cpu``, their own) still pack every tensor: ours
    wrap theirs."""

    def __init__(self, gatherer: UnitGatherer, record: _Gathered):
        self.gatherer, self.record = gatherer, record
        self.storage = record.full.untyped_storage().data_ptr()
        self.live = 0
        self.forward_done = False
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        outer = top(False) if top is not None else None
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)

    def _reads_root(self, t: torch.Tensor) -> bool:
        if t.layout != torch.strided or t.device != self.record.full.device:
            return False
        try:
            return t.untyped_storage().data_ptr() == self.storage
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
            return False

    def pack(self, t: torch.Tensor):
        packed = self.outer_pack(t) if self.outer_pack is not None else t.detach()
        if self._reads_root(t):
            self.live += 1
            return _RootRead(packed, self)
        return packed

    def unpack(self, packed):
        inner = packed.tensor if isinstance(packed, _RootRead) else packed
        return self.outer_unpack(inner) if self.outer_unpack is not None else inner

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def end_forward(self) -> None:
        self.forward_done = True
        if self.live == 0:
            self.gatherer._release_root(self.record)

    def released_one(self) -> None:
        self.live -= 1
        if self.live == 0 and self.forward_done:
            self.gatherer._release_root(self.record)


def _saved_tensor_hooks_allowed() -> bool:
    """False inside ``torch.autograd.graph.disable_saved_tensors_hooks`` (entering hooks there raises)."""
    check = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return check is None or check()


class _RootRead:
    """One saved tensor that reads the root's weights; its deletion is autograd releasing it."""

    __slots__ = ("tensor", "readers")

    def __init__(self, tensor, readers: _RootReaders):
        self.tensor, self.readers = tensor, readers

    def __del__(self):  # autograd let go of this saved tensor
        self.readers.released_one()


class _GatherFn(torch.autograd.Function):
    """Identity from a unit's shard parameter to its gathered flat weights; backward = post-backward."""

    @staticmethod
    def forward(ctx, shard_param, record, engine):
        ctx.record, ctx.engine = record, engine
        return record.full.view_as(record.full)

    @staticmethod
    def backward(ctx, grad_full):
        ctx.engine._post_backward(ctx.record, grad_full)
        return None, None, None


class UnitGatherer:
    """Stage 3's gather / free machinery over a :class:`~pyparallel.zero.engine.ShardEngine` whose flat
    groups are the units (see the module docstring). The engine owns the shards, the reduction and the
    optimizer step; this object owns the hooks and the units' lifetimes."""

    def __init__(self, engine, module: nn.Module, specs: list[UnitSpec], has_root: bool, prefetch: bool = True):
        self.engine = engine
        self.group, self.device, self.prefetch = engine.group, engine.device, prefetch
        self.compute_dtype, self.reduce_dtype = engine.compute_dtype, engine.reduce_dtype
        self.units = [_Unit(i, s, lay) for i, (s, lay) in enumerate(zip(specs, engine.layouts))]
        self.root = self.units[0] if has_root else None
        self._release()
        # The autograd anchor of each unit, and what model.parameters() shows: its slice of the shard the
        # gathers read (the fp32 master itself when there is no compute-dtype copy).
        at_rest = engine._at_rest if engine._at_rest is not None else engine.master
        for u in self.units:
            u.shard_param = nn.Parameter(engine.space.slice(at_rest, u.index), requires_grad=True)
        self._pass: list[_Gathered] | None = None
        order = [u.index for u in self.units if u is not self.root]
        self._next_unit = dict(zip(order, order[1:]))
        self._keep = self._tail_to_keep(order)
        self._round_active = False
        self._touched: list[_Gathered] = []
        for u in self.units:
            if u is not self.root:
                u.spec.module.register_forward_pre_hook(self._hook_pre_forward(u))
                u.spec.module.register_forward_hook(self._hook_post_forward(u))

    @torch.no_grad()
    def _release(self) -> None:
        """Unregister the full parameters (the engine has taken its shards of them)."""
        for u in self.units:
            for p, slots in zip(u.layout.params, u.spec.slots):
                for mod, attr in slots:
                    del mod._parameters[attr]
                    mod.__dict__[attr] = None  # bound to a gathered view inside the unit's forward
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # drop the full copy

    @property
    def shard_params(self) -> list[nn.Parameter]:
        return [u.shard_param for u in self.units]

    # ---------------------------------------------------------------------------------- gathering

    def _issue_gather(self, unit: _Unit, full: torch.Tensor):
        """Start gathering ``unit`` into ``full``; returns (handle, version guard). gloo bumps the output's
        version counter from its worker thread when the gather lands; autograd saved views of this storage
        and compares that counter in backward, so the guard restores the value from before the issue."""
        guard = torch.autograd._unsafe_preserve_version_counter(full)
        shard = self.engine._rest_slice(unit.index)  # kept alive with the handle until the gather lands
        return comm.all_gather(full, shard, self.group, async_op=True), guard, shard

    def _start_gather(self, unit: _Unit) -> _Gathered:
        full = torch.empty(unit.layout.padded, dtype=self.compute_dtype, device=self.device)
        return _Gathered(unit, full, self._issue_gather(unit, full))

    def _materialize(self, unit: _Unit) -> _Gathered:
        record, unit.prefetched = unit.prefetched, None
        if record is None:
            record = self._start_gather(unit)
        record.wait()
        return record

    def _bind(self, unit: _Unit, record: _Gathered) -> None:
        full = record.full
        if torch.is_grad_enabled():
            full = _GatherFn.apply(unit.shard_param, record, self)
        for view, slots in zip(unit.layout.split_views(full), unit.spec.slots):
            for mod, attr in slots:
                mod.__dict__[attr] = view

    # ----------------------------------------------------------------------------------- forward

    def run_forward(self, module: nn.Module, args, kwargs):
        self._pass = []
        root_record = readers = None
        if self.root is not None:
            root_record = self._materialize(self.root)
            self._bind(self.root, root_record)
            if torch.is_grad_enabled() and _saved_tensor_hooks_allowed():
                readers = _RootReaders(self, root_record)
        try:
            with readers.hooks() if readers is not None else contextlib.nullcontext():
                out = module(*args, **kwargs)
        finally:
            order = [r.unit.index for r in self._pass]
            self._pass = None
            self._drop_unused_prefetches()
        if len(order) > 1:
            self._next_unit = dict(zip(order, order[1:]))
        if order:
            self._keep = self._tail_to_keep(order)
        if root_record is not None:
            self._unbind(self.root)
            needs_grad = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if torch.is_grad_enabled() and needs_grad:
                register_multi_grad_hook(needs_grad, self._pre_backward_fn(root_record), mode="any")
                if readers is not None:  # else the weights stay until the root's post-backward
                    readers.end_forward()  # frees them now if no saved tensor reads them
            else:
                self._release_root(root_record)
        return out

    def _release_root(self, record: _Gathered) -> None:
        record.released = True
        if record.handle is None:  # gathered and waited for in forward: nothing in flight
            free_storage(record.full)

    def _hook_pre_forward(self, unit: _Unit):
        def hook(module, args):
            record = self._materialize(unit)
            self._bind(unit, record)
            unit.active.append(record)
            if self._pass is not None:
                record.pass_, record.position = self._pass, len(self._pass)
                self._pass.append(record)
            nxt = self._next_unit.get(unit.index)
            if self.prefetch and nxt is not None:
                target = self.units[nxt]
                if target.prefetched is None and not target.active:
                    target.prefetched = self._start_gather(target)

        return hook

    def _tail_to_keep(self, order: list[int]) -> frozenset[int]:
        """The units at the end of the forward order are the first of the backward: their weights stay
        gathered from their forward into their backward instead of being gathered again a moment later.
        The tail runs back to the last unit of at least half the biggest unit's size (the last transformer
        block, after small ones such as a final norm), so at most about one extra unit is alive when the
        backward starts; ``memory_parts`` counts it."""
        sizes = {u.index: u.layout.padded for u in self.units if u is not self.root}
        biggest = max(sizes.values(), default=0)
        keep = []
        for i in reversed(order):
            keep.append(i)
            if 2 * sizes[i] >= biggest:
                break
        return frozenset(keep)

    def _unbind(self, unit: _Unit) -> None:
        """Outside its forward a unit's parameters read as None (their storage is freed; autograd keeps its
        own references to the views it saved)."""
        for slots in unit.spec.slots:
            for mod, attr in slots:
                mod.__dict__[attr] = None

    def _hook_post_forward(self, unit: _Unit):
        def hook(module, args, output):
            record = unit.active.pop()
            needs_grad = []
            if torch.is_grad_enabled():
                needs_grad = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            keep = bool(needs_grad) and unit.index in self._keep and not unit.active
            if not keep:
                free_storage(record.full)
            if not unit.active:
                self._unbind(unit)
            if needs_grad:
                register_multi_grad_hook(needs_grad, self._pre_backward_fn(record), mode="any")

        return hook

    def _drop_unused_prefetches(self) -> None:
        for u in self.units:
            if u.prefetched is not None:
                u.prefetched.wait()
                u.prefetched = None

    # ---------------------------------------------------------------------------------- backward

    def _start_round(self) -> None:
        if not self._round_active:
            self._round_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_round)

    def _pre_backward_fn(self, record: _Gathered):
        def hook(_grad):
            self._start_round()
            self._touched.append(record)
            self._refill(record)
            record.wait()
            prev = record.pass_[record.position - 1] if record.pass_ and record.position > 0 else None
            if self.prefetch and prev is not None and not prev.backward_done:
                self._refill(prev)

        return hook

    def _refill(self, record: _Gathered) -> None:
        """Start re-gathering a freed unit into its own (autograd-saved) storage."""
        if record.handle is None and not record.released and not storage_allocated(record.full):
            alloc_storage(record.full)
            record.handle = self._issue_gather(record.unit, record.full)
            self._touched.append(record)

    def _post_backward(self, record: _Gathered, grad_full: torch.Tensor) -> None:
        self._start_round()
        record.wait()
        record.backward_done = True
        free_storage(record.full)
        u, eng = record.unit, self.engine
        full = grad_full.to(self.reduce_dtype).contiguous()
        accumulate = not eng._clean[u.index]
        eng._clean[u.index] = False
        # The flat gradient is ours alone (autograd passes it to no one else): reduce it in place.
        eng.reducer.launch(full, eng.space.slice(eng.grad_shard, u.index), accumulate, scratch=True)

    def _finish_round(self) -> None:
        self._round_active = False
        self.engine.reducer.drain()
        for record in self._touched:  # units whose weights came back but whose gradient never did
            record.wait()
            if not record.backward_done:
                free_storage(record.full)
        self._touched = []

    # ------------------------------------------------------------------------------------ report

    def memory_parts(self) -> tuple[dict, dict, int]:
        """(states, buffers, padding elements); see ``ShardEngine.memory_parts``."""
        eng = self.engine
        S, cd, rd = eng.space.numel, self.compute_dtype, self.reduce_dtype
        cb = torch.empty((), dtype=cd).element_size()
        rb = torch.empty((), dtype=rd).element_size()
        frozen = sum(p.numel() * p.element_size() for _, p in eng.frozen)
        at_rest = 0 if eng._at_rest is None else S * eng._at_rest.element_size()
        states = {"params": at_rest + frozen, "grads": S * rb}
        others = [u.layout.padded for u in self.units if u is not self.root]
        biggest = max(others, default=0)
        in_flight = 2 if self.prefetch else 1
        kept = sum(self.units[i].layout.padded for i in self._keep)  # alive as the backward starts
        gathered = max(in_flight * biggest, kept + (biggest if self.prefetch else 0))
        buffers = {"gathered_units": gathered * cb,
                   "reduce_buckets": eng.reducer.max_inflight * biggest * rb}
        if eng._at_rest is None:
            buffers["gather_cast_shards"] = in_flight * (biggest // self.group.size) * cb
        if self.root is not None:
            buffers["gathered_root"] = self.root.layout.padded * cb
        if rd != torch.float32:
            buffers["step_grad_fp32"] = S * 4
        pad = sum(lay.padded - lay.numel for lay in eng.layouts)
        return states, buffers, pad
