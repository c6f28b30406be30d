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
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyparallel import _ops, comm
from pyparallel.tensor_parallel.mappings import (
    allreduce_grad_hook,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
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
        key = (kind, x._version, torch.is_grad_enabled())
        entry = self._entry
        if entry is not None and entry[0]() is x and entry[1] == key:
            return entry[2]
        y = make()
        self._entry = (weakref.ref(x), key, y)
        return y

    def clear(self) -> None:
        self._entry = None


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
        layer.weight.requires_grad_(w.requires_grad)
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

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            kind, make = "seq", lambda: gather_from_sequence(x, self.group, self.sequence_dim)
        else:
            kind, make = "copy", lambda: copy_to_tp(x, self.group)
        return make() if self.input_cache is None else self.input_cache.get(x, kind, make)

    def forward_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        """X A_r without the bias (the fused MLP adds it inside gelu_linear)."""
        return F.linear(self._enter(x), self.weight)  # [.., in] @ [in, out/t] -> [.., out/t]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self._enter(x), self.weight, self.bias)  # [.., in] @ [in, out/t] -> [.., out/t]
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
            self.bias.register_hook(allreduce_grad_hook(self.group))

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
        layer.layout = layout
        return layer

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, self.group, self.sequence_dim)
        else:
            y = reduce_from_tp(partial, self.group)
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, -1)
        return self._reduce(F.linear(x, self.weight))  # [.., in/t] @ [in/t, out] -> partial [.., out]

    def forward_gelu(self, z: torch.Tensor, z_bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
        """``g(gelu(z + z_bias) @ A_r) + bias`` with the fused kernel: gelu(z + z_bias) is never stored."""
        return self._reduce(_ops.gelu_linear(z, z_bias, self.weight, approximate))  # [.., in/t] -> [.., out]

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
        layer.weight.requires_grad_(module.weight.requires_grad)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
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
            out = reduce_from_tp(out, self.group)
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
