"""Megatron's tensor-parallel layers (Shoeybi et al. 2019, §3): column- and row-split linear layers and the
vocabulary-split embedding. Each takes its TP group from the mesh (``mesh.tp_group``).

For ``Y = X A`` with ``A`` of shape [in, out] (stored, as in ``nn.Linear``, as ``weight`` [out, in]):

* :class:`ColumnParallelLinear` holds ``out / t`` output features (rows of ``weight``); its replicated input
  passes through ``f`` (gradient all-reduce), its output stays split unless ``gather_output``.
* :class:`RowParallelLinear` holds ``in / t`` input features (columns of ``weight``); the partial products
  are summed by ``g`` (all-reduce), after which the (replicated) bias is added once.

A column layer followed by a row layer (the MLP, or attention split by heads) therefore costs one
all-reduce forward and one backward. With ``sequence_parallel`` (Korthikanti et al. 2022) the all-reduces
become an all-gather of the sequence shards before the column layer and a reduce-scatter after the row
layer, and the activations between layers are split along the sequence dimension.

``from_linear`` slices an existing full ``nn.Linear`` (or a GPT-2 ``Conv1D``, whose weight is [in, out]) so
the parallel layer computes exactly what the original did; ``full_parameters`` gathers the shards back.

**Overlap.** A column-parallel layer's backward computes the input gradient first, starts its all-reduce
(or, with sequence parallelism, its reduce-scatter) asynchronously, computes the weight and bias gradients
while it is on the wire, then waits (as Megatron-LM's implementation of these layers does; picotron's
``LinearWithAsyncAllReduce`` is the same idea). The entry mapping and the matmuls
are therefore one autograd function (:class:`_ColumnParallelMatmuls`), for one layer or for several that
read the same input (q, k, v: :func:`column_parallel_group`, one reduction for all of them). Under
sequence parallelism the all-gathered input is kept for the weight gradient, as the unfused layer kept it,
rather than gathered again in backward as Megatron does: no extra all-gather, the same memory as before.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyparallel import _ops, comm
from pyparallel.data.tokens import check_token_ids
from pyparallel.tensor_parallel.mappings import (
    SharedInput,
    _gather,
    _reduce_scatter,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    register_allreduce_grad_hook,
    scatter_to_tp,
    start_reduce_scatter,
)


class InputCache:
    """Shares the entry mapping (``f``, or the sequence all-gather) among column-parallel layers that read
    the same tensor, e.g. the q, k and v projections of one attention: the gradient of their common input
    is then all-reduced once, not three times. One entry; a hit needs the very same tensor object, unchanged
    (same version) and the same grad mode. The entry keeps the mapped tensor alive until ``clear()`` or
    the next miss; whoever owns the cache clears it after the forward that used it."""

    def __init__(self):
        self._entry = None

    def get(self, x: torch.Tensor, kind: str, make):
        """The mapped tensor for ``x`` and its :class:`SharedInput` (``make(shared)`` maps on a miss; a hit
        counts one more reader)."""
        key = (kind, x._version, torch.is_grad_enabled())
        entry = self._entry
        if entry is not None and entry[0]() is x and entry[1] == key:
            entry[3].readers += 1
            return entry[2], entry[3]
        shared = SharedInput(kind)
        y = make(shared)
        self._entry = (weakref.ref(x), key, y, shared)
        return y, shared

    def holds(self, x: torch.Tensor, kind: str) -> bool:
        entry = self._entry
        return (entry is not None and entry[0]() is x
                and entry[1] == (kind, x._version, torch.is_grad_enabled()))

    def clear(self) -> None:
        self._entry = None


def _autocast(x: torch.Tensor) -> bool:
    """Autocast is on for ``x``'s device (the fused functions then step aside: autograd's own casts)."""
    return x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)


class _ColumnParallelMatmuls(torch.autograd.Function):
    """``Y_i = X A_i + a_i`` for one or more column-parallel weights reading one input, with the entry
    mapping fused in (Shoeybi et al. 2019, §3; sequence parallelism: Korthikanti et al. 2022, §4.2.2).

    ``mode``: ``"copy"`` (``x`` replicated: the input gradient is all-reduced), ``"seq"`` (``x`` is this
    rank's sequence shard: all-gathered along ``dim`` in forward, the input gradient reduce-scattered),
    or ``"shared"`` (``x`` already went through a :class:`SharedInput` entry, which reduces the summed
    gradient, unless this layer is its lone reader in the replicated mode: then this layer does, overlapped).
    ``params`` = (weight_0, bias_0, weight_1, bias_1, ...), biases may be None. Backward: input gradient
    first (a fresh buffer, reduced in place), its reduction started asynchronously, the weight and bias
    gradients computed meanwhile, then the wait. The same products as ``F.linear``'s autograd (2-D GEMMs
    over the flattened tokens); several weights accumulate into one input gradient."""

    @staticmethod
    def forward(ctx, x, group, mode, dim, shared, *params):
        full = _gather(x, group, dim) if mode == "seq" else x
        ctx.group, ctx.mode, ctx.dim, ctx.shared = group, mode, dim, shared
        ctx.save_for_backward(full, *params)
        return tuple(F.linear(full, params[i], params[i + 1]) for i in range(0, len(params), 2))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        full, *params = ctx.saved_tensors
        need = ctx.needs_input_grad
        gys = [g.reshape(-1, g.shape[-1]) for g in grads]  # [tokens, out_i/t]
        handle = keep = result = None
        if need[0]:
            d = None
            for gy, w in zip(gys, params[0::2]):  # [tokens, out/t] @ [out/t, in] -> [tokens, in]
                d = gy.mm(w) if d is None else d.addmm_(gy, w)
            d = d.view(full.shape)
            if ctx.mode == "copy" or (ctx.mode == "shared" and ctx.shared.reduced_by_reader):
                result, handle = d, comm.all_reduce(d, ctx.group, async_op=True)  # d is ours: in place
            elif ctx.mode == "seq":
                result, handle, keep = start_reduce_scatter(d, ctx.group, ctx.dim)
            else:
                result = d  # the shared entry reduces the sum of its readers' gradients
        x2 = full.reshape(-1, full.shape[-1])
        out = []
        for i, gy in enumerate(gys):  # while the input gradient is on the wire
            w, b = params[2 * i], params[2 * i + 1]
            out.append(gy.t().mm(x2) if need[5 + 2 * i] else None)  # [out/t, tokens] @ [tokens, in]
            out.append(gy.sum(0) if b is not None and need[6 + 2 * i] else None)
        if handle is not None:
            handle.wait()
        del keep
        return (result, None, None, None, None, *out)


class _RowParallelMatmul(torch.autograd.Function):
    """``g(X_r A_r)`` (or ``g(gelu(Z + a) A_r)`` with the fused kernel) in one function: the partial product
    is made here and read by nothing else, so it is summed in place (Megatron's ``g``, Shoeybi et al. 2019,
    §3), or reduce-scattered along the sequence from its rank-major copy (Korthikanti et al. 2022). Backward:
    ``g``'s identity (or the all-gather of the sequence shards) then the matmul's own gradients, the same
    products as ``F.linear``'s autograd and :func:`pyparallel._ops.gelu_linear`'s."""

    @staticmethod
    def forward(ctx, x, weight, z_bias, group, seq, dim, approximate):
        if approximate is None:
            partial = F.linear(x, weight)  # [.., in/t] @ [in/t, out] -> [.., out]
        else:
            partial = _ops.gelu_linear_forward(x, z_bias, weight, approximate)
            if partial._base is not None:  # the kernel returns a reshaped view of its own buffer: own it
                partial = torch.ops.aten._unsafe_view(partial, partial.shape)
        ctx.save_for_backward(x, z_bias, weight)
        ctx.group, ctx.seq, ctx.dim, ctx.approximate = group, seq, dim, approximate
        if seq:
            return _reduce_scatter(partial, group, dim)
        if not partial.is_contiguous():
            partial = partial.contiguous()
        comm.all_reduce(partial, group)  # ours alone: in place
        return partial

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, z_bias, weight = ctx.saved_tensors
        if ctx.seq:
            gy = _gather(gy, ctx.group, ctx.dim)  # [.., s/t, out] -> [.., s, out]
        need = ctx.needs_input_grad
        if ctx.approximate is not None:
            mask = [need[0], need[2] and z_bias is not None, need[1]]
            dz, db, dw = _ops.gelu_linear_backward(gy, x, z_bias, weight, ctx.approximate, mask)
            return ((dz if mask[0] else None), (dw if mask[2] else None), (db if mask[1] else None),
                    None, None, None, None)
        gy2 = gy.reshape(-1, gy.shape[-1])
        dx = gy2.mm(weight).view(x.shape) if need[0] else None  # [tokens, out] @ [out, in/t]
        dw = gy2.t().mm(x.reshape(-1, x.shape[-1])) if need[1] else None  # [out, tokens] @ [tokens, in/t]
        return dx, dw, None, None, None, None, None


def column_parallel_group(layers, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of several :class:`ColumnParallelLinear` layers on the same input ``x`` (q, k and v),
    computed by one fused function: one reduction of the input gradient in backward, overlapped with all
    of their weight gradients. The layers must agree on the group and the sequence parallelism and
    neither gather their outputs nor pad a vocabulary."""
    first = layers[0]
    for layer in layers:
        if (layer.group is not first.group or layer.sequence_parallel != first.sequence_parallel
                or layer.sequence_dim != first.sequence_dim or layer.gather_output or layer.padded):
            raise ValueError("column_parallel_group: the layers must share the group and the sequence "
                             "parallelism, without gather_output or vocabulary padding")
    return first._matmuls(x, [(layer.weight, layer.bias) for layer in layers], share=False)


def _check_divisible(name: str, what: str, value: int, t: int) -> None:
    if value % t:
        raise ValueError(f"{name}: {what} ({value}) is not divisible by the tensor-parallel degree tp={t}; "
                         f"choose a tp that divides {value}")


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(weight as [out, in], bias, layout) of an ``nn.Linear`` or a transformers ``Conv1D`` ([in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.t(), module.bias, "conv1d"
    raise ValueError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")


def shard_rows(full: torch.Tensor, t: int, r: int, sections: tuple[int, ...] | None = None) -> torch.Tensor:
    """Rank r's rows of ``full``: chunk r of each section (e.g. of q, k and v in a fused QKV weight)."""
    parts = full.split(list(sections)) if sections else [full]
    return torch.cat([p.chunk(t)[r] for p in parts])


def unshard_rows(gathered: torch.Tensor, sections: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_rows` given every rank's rows stacked as [t, rows_local, ...]."""
    t = gathered.shape[0]
    if not sections:
        return gathered.reshape(-1, *gathered.shape[2:])
    local = [s // t for s in sections]
    pieces = gathered.split(local, dim=1)  # per section: [t, s/t, ...]
    return torch.cat([p.reshape(-1, *p.shape[2:]) for p in pieces])


def _all_gather_stack(x: torch.Tensor | None, group: comm.Group) -> torch.Tensor:
    x = x.detach().contiguous()
    out = x.new_empty((group.size, *x.shape))
    comm.all_gather(out.view(-1), x.view(-1), group)
    return out


def _value(p: nn.Parameter, grad: bool) -> torch.Tensor:
    """The parameter, or its gradient (zeros when it has none, so every rank gathers the same shapes)."""
    if not grad:
        return p
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _keep_requires_grad(layer: nn.Module, source: nn.Module) -> None:
    """Each shard trains exactly when the parameter it was cut from does (a frozen weight or bias stays
    frozen). Read from the source's own parameters, not from ``linear_weight``'s transposed view of a
    ``Conv1D`` weight, whose flag is False under ``torch.no_grad()`` whatever the parameter's."""
    for pname in ("weight", "bias"):
        new, old = getattr(layer, pname, None), getattr(source, pname, None)
        if new is not None and old is not None:
            new.requires_grad_(old.requires_grad)


def _to_layout(w: torch.Tensor, layout: str) -> torch.Tensor:
    return w.t().contiguous() if layout == "conv1d" else w


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (vocabulary padding)."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _full_linear_init(out_f: int, in_f: int, bias: bool, dtype, device):
    """nn.Linear's default initialisation of the full matrix (same RNG stream on every rank -> same
    matrix), from which each rank keeps its shard."""
    w = torch.empty(out_f, in_f, dtype=dtype, device=device)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1 / math.sqrt(in_f) if in_f > 0 else 0
        b = torch.empty(out_f, dtype=dtype, device=device).uniform_(-bound, bound)
    return w, b


def padded_vocab_size(vocab: int, t: int, multiple: int | None) -> int:
    """Megatron's ``--make-vocab-size-divisible-by``: the vocabulary padded to a multiple of ``t·multiple``
    when ``t`` does not divide it (a vocabulary that already splits evenly keeps its exact size). ``multiple``
    None refuses instead. Every rank must keep at least one real row (the padding is < t·multiple rows)."""
    if vocab % t == 0:
        return vocab
    if not multiple:
        raise ValueError(f"vocabulary size {vocab} is not divisible by the tensor-parallel degree tp={t} and "
                         f"vocabulary padding is off; pass vocab_multiple=64 (pads to a multiple of tp x 64) or "
                         f"choose a tp that divides {vocab}")
    step = t * int(multiple)
    padded = -(-vocab // step) * step
    if vocab <= (t - 1) * (padded // t):
        raise ValueError(f"vocabulary size {vocab} padded to {padded} (a multiple of tp={t} x {multiple}) would "
                         f"leave tensor-parallel rank {t - 1} without a real row; use a smaller vocab_multiple")
    return padded


class ColumnParallelLinear(nn.Module):
    """``Y_r = X A_r``: the output features split over the TP ranks.

    ``sections`` splits each of several stacked outputs separately (a fused QKV of sizes (h, h, h): each
    rank holds its heads of q, of k and of v). ``input_cache`` lets sibling layers share one ``f``.
    ``valid_out`` < ``out_features`` marks the rows past it as vocabulary padding (an LM head padded as
    Megatron's ``make-vocab-size-divisible-by``): they are zero, their logits are -inf (they never win the
    softmax and get no gradient), gathered outputs and :meth:`full_parameters` are cut back to
    ``valid_out``, and checkpoints never see them."""

    def __init__(self, in_features: int, out_features: int, mesh, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, sequence_dim: int = 1,
                 sections: tuple[int, ...] | None = None, input_cache: InputCache | None = None,
                 name: str = "ColumnParallelLinear", dtype=None, device=None, init: bool = True,
                 valid_out: int | None = None):
        super().__init__()
        self.group = mesh.tp_group
        t, r = self.group.size, self.group.rank
        self.sections = tuple(sections) if sections else None
        self.valid_out = out_features if valid_out is None else int(valid_out)
        if not 0 < self.valid_out <= out_features or (self.sections and self.valid_out != out_features):
            raise ValueError(f"{name}: valid_out {self.valid_out} must be in (0, {out_features}] and needs a "
                             f"layer without sections")
        if self.sections and sum(self.sections) != out_features:
            raise ValueError(f"{name}: sections {self.sections} do not add up to out_features {out_features}")
        for s in self.sections or (out_features,):
            _check_divisible(name, "output features" if not self.sections else f"section of {s} features", s, t)
        if gather_output and self.sections and len(self.sections) > 1:
            raise ValueError(f"{name}: gather_output with several sections would interleave them by rank")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.sequence_dim = gather_output, sequence_parallel, sequence_dim
        self.input_cache = input_cache  # None: map every call (nothing shared)
        self.layout = "linear"
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features // t, dtype=dtype, device=device)) if bias else None
        self.local_start = r * (out_features // t)  # first (global) row this rank holds, without sections
        # Real rows of this rank's shard: the rest is vocabulary padding.
        self.local_valid = max(0, min(out_features // t, self.valid_out - self.local_start))
        if init:
            w, b = _full_linear_init(self.valid_out, in_features, bias, dtype, device)
            with torch.no_grad():
                self.weight.copy_(shard_rows(_pad_rows(w, out_features), t, r, self.sections))
                if bias:
                    self.bias.copy_(shard_rows(_pad_rows(b, out_features), t, r, self.sections))

    @classmethod
    def from_linear(cls, module: nn.Module, mesh, *, padded_out: int | None = None, **kwargs) -> ColumnParallelLinear:
        """Slice a full ``nn.Linear`` / ``Conv1D``: this rank keeps its rows (of each section). With
        ``padded_out`` the output features are first padded with zero rows to that size (vocabulary padding)."""
        w, b, layout = linear_weight(module)
        out = padded_out or w.shape[0]
        layer = cls(w.shape[1], out, mesh, bias=b is not None, dtype=w.dtype, device=w.device,
                    init=False, valid_out=w.shape[0], **kwargs)
        t, r = layer.group.size, layer.group.rank
        with torch.no_grad():
            layer.weight.copy_(shard_rows(_pad_rows(w, out), t, r, layer.sections))
            if b is not None:
                layer.bias.copy_(shard_rows(_pad_rows(b, out), t, r, layer.sections))
        _keep_requires_grad(layer, module)
        layer.layout = layout
        return layer

    @property
    def padded(self) -> bool:
        return self.valid_out != self.out_features

    def _mask_padding(self, y: torch.Tensor) -> torch.Tensor:
        """-inf on the padded vocabulary columns of this rank: they never win a softmax or a max, and
        masked_fill passes them no gradient (so the zero padding rows stay zero)."""
        if not self.padded or self.local_valid == self.weight.shape[0]:
            return y
        pad = torch.arange(y.shape[-1], device=y.device) >= self.local_valid
        return y.masked_fill(pad, float("-inf"))

    def _matmuls(self, x: torch.Tensor, params, share: bool) -> tuple[torch.Tensor, ...]:
        """``x @ W.T + b`` for each (W, b) of ``params``, with this layer's entry mapping. ``share``: go
        through the input cache (one entry for sibling layers reading ``x``)."""
        group, sp, dim = self.group, self.sequence_parallel, self.sequence_dim
        flat = [p for wb in params for p in wb]
        if group.size == 1:
            return tuple(F.linear(x, w, b) for w, b in params)
        if _autocast(x):  # autograd's own casts: the unfused path, unchanged
            x = gather_from_sequence(x, group, dim) if sp else copy_to_tp(x, group)
            return tuple(F.linear(x, w, b) for w, b in params)
        kind = "seq" if sp else "copy"
        if not share or self.input_cache is None:
            return _ColumnParallelMatmuls.apply(x, group, kind, dim, None, *flat)

        def make(shared):
            return gather_from_sequence(x, group, dim) if sp else copy_to_tp(x, group, shared)

        mapped, shared = self.input_cache.get(x, kind, make)
        return _ColumnParallelMatmuls.apply(mapped, group, "shared", dim, shared, *flat)

    def forward_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        """X A_r without the bias (the fused MLP adds it inside gelu_linear). The MLP's input is read by no
        other column layer (sequential blocks) unless the cache already holds it: it goes through the fused
        path, whose input-gradient reduction overlaps the weight gradient."""
        kind = "seq" if self.sequence_parallel else "copy"
        share = self.input_cache is not None and self.input_cache.holds(x, kind)
        return self._matmuls(x, [(self.weight, None)], share)[0]  # [.., in] @ [in, out/t] -> [.., out/t]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmuls(x, [(self.weight, self.bias)], share=True)[0]  # [.., in] @ [in, out/t] -> [.., out/t]
        y = self._mask_padding(y)
        if not self.gather_output:
            return y
        y = gather_from_tp(y, self.group, -1)  # [.., out] (padded)
        return y[..., :self.valid_out] if self.padded else y

    def full_parameters(self, grad: bool = False) -> dict[str, torch.Tensor]:
        """Every rank's shards (or their gradients) gathered back into the original module's layout, without
        vocabulary padding (a collective)."""
        n = self.valid_out
        w = unshard_rows(_all_gather_stack(_value(self.weight, grad), self.group), self.sections)
        out = {"weight": _to_layout(w[:n], self.layout)}
        if self.bias is not None:
            out["bias"] = unshard_rows(_all_gather_stack(_value(self.bias, grad), self.group), self.sections)[:n]
        return out

    def extra_repr(self) -> str:
        pad = f", padded from {self.valid_out}" if self.padded else ""
        return (f"in={self.in_features}, out={self.out_features}{pad} (local {self.weight.shape[0]}), "
                f"tp={self.group.size}, gather_output={self.gather_output}, sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r A_r``: the input features split over the TP ranks, partial outputs summed by ``g``
    (or reduce-scattered along the sequence with ``sequence_parallel``); the bias is added after."""

    def __init__(self, in_features: int, out_features: int, mesh, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, sequence_dim: int = 1,
                 name: str = "RowParallelLinear", dtype=None, device=None, init: bool = True):
        super().__init__()
        self.group = mesh.tp_group
        t, r = self.group.size, self.group.rank
        _check_divisible(name, "input features", in_features, t)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.sequence_dim = (input_is_parallel, sequence_parallel,
                                                                             sequence_dim)
        self.layout = "linear"
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        if init:
            w, b = _full_linear_init(out_features, in_features, bias, dtype, device)
            with torch.no_grad():
                self.weight.copy_(w.chunk(t, dim=1)[r])
                if bias:
                    self.bias.copy_(b)
        if sequence_parallel and self.bias is not None:
            # Added on 1/t of the tokens: each rank's bias gradient is a partial sum.
            register_allreduce_grad_hook(self.bias, self.group)

    @classmethod
    def from_linear(cls, module: nn.Module, mesh, **kwargs) -> RowParallelLinear:
        """Slice a full ``nn.Linear`` / ``Conv1D``: this rank keeps its columns; the bias is replicated."""
        w, b, layout = linear_weight(module)
        layer = cls(w.shape[1], w.shape[0], mesh, bias=b is not None, dtype=w.dtype, device=w.device,
                    init=False, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(w.chunk(layer.group.size, dim=1)[layer.group.rank])
            if b is not None:
                layer.bias.copy_(b)
        _keep_requires_grad(layer, module)
        layer.layout = layout
        return layer

    def _product(self, x: torch.Tensor, z_bias: torch.Tensor | None, approximate: str | None) -> torch.Tensor:
        """The reduced (or reduce-scattered) ``x @ A_r`` (``gelu(x + z_bias) @ A_r`` with ``approximate``)."""
        group, sp, dim = self.group, self.sequence_parallel, self.sequence_dim
        if group.size > 1 and not _autocast(x):
            y = _RowParallelMatmul.apply(x, self.weight, z_bias, group, sp, dim, approximate)
        else:  # one rank, or autocast (autograd's own casts): the unfused path
            if approximate is None:
                partial = F.linear(x, self.weight)
            else:
                partial = _ops.gelu_linear(x, z_bias, self.weight, approximate)
            y = reduce_scatter_to_sequence(partial, group, dim) if sp else reduce_from_tp(partial, group)
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, -1)
        return self._product(x, None, None)  # [.., in/t] @ [in/t, out] -> [.., out], summed over the ranks

    def forward_gelu(self, z: torch.Tensor, z_bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
        """``g(gelu(z + z_bias) @ A_r) + bias`` with the fused kernel: gelu(z + z_bias) is never stored."""
        return self._product(z, z_bias, approximate)  # [.., in/t] -> [.., out]

    def full_parameters(self, grad: bool = False) -> dict[str, torch.Tensor]:
        g = _all_gather_stack(_value(self.weight, grad), self.group)  # [t, out, in/t]
        out = {"weight": _to_layout(torch.cat(g.unbind(0), dim=1), self.layout)}
        if self.bias is not None:
            out["bias"] = _value(self.bias, grad).detach().clone()
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
                f"tp={self.group.size}, input_is_parallel={self.input_is_parallel}, sp={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by vocabulary rows: rank r holds tokens [r·Vp/t, (r+1)·Vp/t). Each rank
    looks up the tokens it owns (zeros for the others) and ``g`` sums the results.

    ``padded_size`` (>= ``num_embeddings``, divisible by t) pads the table with zero rows that no token id
    reaches (Megatron's ``make-vocab-size-divisible-by``); :meth:`full_parameters` and checkpoints cut them.
    ``scale`` multiplies the looked-up rows (Gemma's ``embed_scale`` = sqrt(hidden), applied in the
    weight's dtype as transformers does)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh, *, padding_idx: int | None = None,
                 sequence_parallel: bool = False, sequence_dim: int = 1, name: str = "VocabParallelEmbedding",
                 dtype=None, device=None, init: bool = True, padded_size: int | None = None,
                 scale: torch.Tensor | float | None = None):
        super().__init__()
        self.group = mesh.tp_group
        t, r = self.group.size, self.group.rank
        padded = num_embeddings if padded_size is None else int(padded_size)
        if padded < num_embeddings:
            raise ValueError(f"{name}: padded_size {padded} is smaller than the vocabulary {num_embeddings}")
        _check_divisible(name, "vocabulary size" if padded == num_embeddings else "padded vocabulary size", padded, t)
        self.num_embeddings, self.embedding_dim, self.padded_size = num_embeddings, embedding_dim, padded
        self.layer_name = name  # for the error on an id outside the vocabulary
        self.padding_idx = padding_idx
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        per = padded // t
        self.vocab_start, self.vocab_end = r * per, (r + 1) * per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim, dtype=dtype, device=device))
        if scale is not None:  # a buffer, as in transformers (non-persistent: recomputed from the config)
            self.register_buffer("embed_scale", torch.as_tensor(scale, device=device).clone(), persistent=False)
        else:
            self.embed_scale = None
        if init:
            full = torch.randn(num_embeddings, embedding_dim, dtype=dtype, device=device)  # nn.Embedding's N(0, 1)
            if padding_idx is not None:
                full[padding_idx].zero_()
            with torch.no_grad():
                self.weight.copy_(_pad_rows(full, padded)[self.vocab_start:self.vocab_end])

    @property
    def valid_rows(self) -> int:
        """Rows of this rank's shard that are real tokens (the rest is padding)."""
        return max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)

    @classmethod
    def from_embedding(cls, module: nn.Embedding, mesh, **kwargs) -> VocabParallelEmbedding:
        layer = cls(module.num_embeddings, module.embedding_dim, mesh, padding_idx=module.padding_idx,
                    dtype=module.weight.dtype, device=module.weight.device, init=False, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_pad_rows(module.weight, layer.padded_size)[layer.vocab_start:layer.vocab_end])
        _keep_requires_grad(layer, module)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # An id no rank owns (>= num_embeddings, also a padding row, or < 0) would be summed as zeros.
        check_token_ids(idx, self.num_embeddings, f"{self.layer_name}: input id")
        pad = self.padding_idx
        if pad is not None and pad < 0:
            pad += self.num_embeddings
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        local_pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        out = F.embedding(local, self.weight, local_pad)  # [..] -> [.., h], rows of other ranks zeroed below
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence(out, self.group, self.sequence_dim)
        else:
            out = reduce_from_tp(out, self.group, owned=True)  # masked_fill's fresh output: in place
        if self.embed_scale is not None:  # after the sum: one real row plus zeros, scaled as the original
            out = out * self.embed_scale.to(self.weight.dtype)
        return out

    def full_parameters(self, grad: bool = False) -> dict[str, torch.Tensor]:
        """The whole table (or its gradient) without padding rows (a collective)."""
        full = unshard_rows(_all_gather_stack(_value(self.weight, grad), self.group))
        return {"weight": full[:self.num_embeddings]}

    def extra_repr(self) -> str:
        pad = f" (padded to {self.padded_size})" if self.padded_size != self.num_embeddings else ""
        scale = ", scaled" if self.embed_scale is not None else ""
        return (f"{self.num_embeddings}{pad}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.group.size}{scale}")
