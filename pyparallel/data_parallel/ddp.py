"""Distributed data parallel: one replica per rank, gradients averaged with bucketed all-reduces that
overlap backward (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training").

Order of events in a step:

1. ``forward`` broadcasts buffers from DP rank 0 (running statistics stay identical) and arms the hooks.
2. In backward, each parameter's post-accumulate-grad hook moves its gradient into its bucket. When a
   bucket is complete, and every earlier bucket has been launched, its async all-reduce starts. Launching
   strictly in bucket order keeps every rank's sequence of collectives identical even when ranks finish
   buckets in a different order (or one rank skips a parameter).
3. A callback queued on the autograd engine runs when backward ends: it launches what is left, waits for
   every reduction, and deals with parameters that received no gradient.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from pyparallel import _ops, comm
from pyparallel.data_parallel.bucket import Bucket, build_buckets
from pyparallel.mesh import ParallelMesh


def check_same_parameters(named_params, group: comm.Group, what: str = "data-parallel") -> None:
    """Fail on every rank, naming the first differing parameter, when ranks hold different models.

    One all-gather of (name, shape, dtype) triples, so it can neither hang on a shape mismatch nor
    corrupt anything: it is the first collective a wrapper issues."""
    check_same_signature([(n, tuple(p.shape), str(p.dtype)) for n, p in named_params], group, what)


def check_same_signature(mine: list[tuple[str, tuple, str]], group: comm.Group, what: str) -> None:
    """:func:`check_same_parameters` on (name, shape, dtype) triples taken earlier (before a wrapper split
    the model, so that the check can come after its own configuration errors and still see whole tensors)."""
    everyone = comm.all_gather_object(mine, group)
    for theirs in everyone:
        if theirs == everyone[0]:
            continue
        for i in range(max(len(theirs), len(everyone[0]))):
            a = everyone[0][i] if i < len(everyone[0]) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                sides = "; ".join(
                    f"rank {group.ranks[k]} has "
                    + (f"'{e[i][0]}' shape {e[i][1]} {e[i][2]}" if i < len(e) else "no parameter")
                    for k, e in enumerate(everyone)
                )
                raise ValueError(
                    f"{what} ranks hold different models: parameter #{i} differs ({sides}). Every rank "
                    f"must build the same model (same config and code) before wrapping it."
                )


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], group: comm.Group, src: int = 0) -> None:
    """Broadcast tensors from group rank ``src`` with one collective per dtype (flattened)."""
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, dev), ts in by_dtype.items():
        flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=dev)
        _ops.flatten_into([t.detach() for t in ts], flat)
        comm.broadcast(flat, src, group)
        _ops.unflatten_from(flat, [t.detach() for t in ts])


class DataParallel(nn.Module):
    """Wrap ``module`` for data parallelism over ``mesh``'s DP axis.

    Args:
        module: the model; every rank must build the same one (checked at wrap time).
        mesh: the :class:`ParallelMesh`; its ``dp_group`` carries the all-reduces.
        bucket_cap_mb: bucket size in MiB (25 as in PyTorch DDP): a bucket takes parameters until it holds
            this much, so it exceeds the cap by at most its last parameter (as PyTorch DDP's do).
        find_unused_parameters: allow parameters that get no gradient on some or all ranks in a step.
            Costs one extra all-reduce of one byte per parameter. A parameter unused on every rank keeps
            ``grad=None`` (as in a single process, so optimizers skip it); one used on some ranks gets
            the average with zeros from the others. Without the flag, a parameter without gradient
            raises an error naming it (after the step's reductions complete, so no rank hangs).
        broadcast_buffers: copy buffers from DP rank 0 at every forward (as torch DDP does).
        reduce_dtype: reduce gradients in this dtype (e.g. torch.float32 for a bf16 model; gloo sums
            bf16 in bf16). Default: the gradient dtype.
        weights: a safetensors file or Hugging Face folder (the module's own names) that every replica loads
            whole; the module may be built on the meta device. Keys and shapes are a ValueError before any
            collective.
        init: for a meta module without ``weights``: ``init(name, module)`` (default: the model's
            ``init_module``, else ``reset_parameters()``) under
            ``materialize.seed_of(name)``, as ``pyparallel.materialize`` documents.
    """

    def __init__(self, module: nn.Module, mesh: ParallelMesh, bucket_cap_mb: float = 25.0, *,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 reduce_dtype: torch.dtype | None = None, weights=None, init=None):
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        from pyparallel import materialize

        reader = materialize.open_source(module, mesh.device, weights, init)  # before any collective
        if reader is not None:  # a replica holds every tensor whole
            materialize.rebuild_buffers(module, mesh.device, materialize.loadable(module, reader))
            materialize.load_in_place(module, reader, mesh.device)
        self.module = module
        self.mesh = mesh
        self.group = mesh.dp_group
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.reduce_dtype = reduce_dtype
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        check_same_parameters(list(module.named_parameters()), self.group)
        if reader is None:  # loaded replicas read the same values already
            broadcast_tensors([p for _, p in module.named_parameters()] + list(module.buffers()), self.group)
        self.buckets: list[Bucket] = build_buckets(named, int(bucket_cap_mb * 2**20))
        for b in self.buckets:
            if reduce_dtype is not None and reduce_dtype != b.buffer.dtype:
                b.comm_buffer = torch.empty(b.buffer.numel(), dtype=reduce_dtype, device=b.buffer.device)
            for i in range(len(b.params)):
                b.params[i].grad = b.views[i]  # gradient_as_bucket_view from the first step on
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named]
        self._sync = True
        self._callback_queued = False
        self._next_launch = 0

    # -------------------------------------------------------------------------------- user API

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.group.size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_tensors(buffers, self.group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block; the first backward outside
        it reduces the accumulated sum. For gradient accumulation over micro-batches."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ------------------------------------------------------------------------------ backward path

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            for b in self.buckets:
                b.reset()
            self._next_launch = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket, i = self._where[id(param)]
        bucket.adopt_grad(i)
        bucket.ready[i] = True
        if bucket.pending == 0:
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        if bucket.comm_buffer is not None:
            bucket.comm_buffer.copy_(bucket.buffer)
            bucket.handle = comm.all_reduce(bucket.comm_buffer, self.group, op="avg", async_op=True)
        else:
            bucket.handle = comm.all_reduce(bucket.buffer, self.group, op="avg", async_op=True)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        missing: list[str] = []
        used = []
        for b in self.buckets:
            for i, ok in enumerate(b.ready):
                used.append(ok)
                if not ok:
                    missing.append(b.names[i])
                    b.views[i].zero_()  # contribute nothing, but keep every rank's collectives aligned
                    b.ready[i] = True
        self._launch_in_order()
        usage = None
        if self.find_unused_parameters:
            usage = torch.tensor(used, dtype=torch.int32, device=self.buckets[0].buffer.device)
            comm.all_reduce(usage, self.group, op="sum")
        for b in self.buckets:
            b.handle.wait()
            if b.comm_buffer is not None:
                b.buffer.copy_(b.comm_buffer)
        k = 0
        for b in self.buckets:
            for i, p in enumerate(b.params):
                p.grad = None if (usage is not None and int(usage[k]) == 0) else b.views[i]
                k += 1
        if missing and not self.find_unused_parameters:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise RuntimeError(
                f"DataParallel: {len(missing)} parameter(s) received no gradient on DP rank {self.group.rank} "
                f"this step: {shown}. Pass find_unused_parameters=True if some parameters are legitimately "
                f"unused, or set requires_grad=False on parameters that are never trained."
            )
