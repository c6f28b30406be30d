"""Megatron's transformer sub-blocks (Shoeybi et al. 2019, §3, Fig. 3): each is a column-parallel layer
followed by a row-parallel one, so each costs one all-reduce of b·s·h in forward (``g``) and one in
backward (``f``).

* :class:`ParallelMLP`: h -> ffn (column) -> GeLU -> h (row). The GeLU and the first layer's bias are fused
  into the row-parallel matmul (:func:`pyparallel._ops.gelu_linear`), so autograd keeps the
  pre-activation Z only, not GeLU(Z) as well.
* :class:`ParallelSelfAttention`: the heads split over the ranks (q, k, v column-parallel, sharing one
  ``f``; o row-parallel). Grouped-query attention (Ainslie et al. 2023) splits the KV heads the same way,
  so every rank keeps whole groups.

Dropout (tensor_parallel/random.py): attention dropout acts on this rank's heads and draws from the
model-parallel stream; the MLP's output dropout acts on the replicated residual stream and draws from the
default generator, except under sequence parallelism, where each rank holds its own slice of the sequence.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyparallel.tensor_parallel import random as tp_random
from pyparallel.tensor_parallel.layers import ColumnParallelLinear, InputCache, RowParallelLinear, column_parallel_group

_GELU_BY_NAME = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


class ParallelMLP(nn.Module):
    """``dropout(GeLU(x A + a) B + b)`` with A column- and B row-parallel; GeLU fused into B's matmul.

    ``names`` keeps the original module's attribute names (("fc_in", "fc_out") for the built-in GPT,
    ("c_fc", "c_proj") for GPT-2) so parameter names survive :func:`parallelize`."""

    def __init__(self, hidden: int, ffn: int, mesh, *, bias: bool = True, approximate: str = "tanh",
                 dropout: float = 0.0, sequence_parallel: bool = False, names: tuple[str, str] = ("fc_in", "fc_out"),
                 input_cache: InputCache | None = None, name: str = "ParallelMLP", init: bool = True,
                 dtype=None, device=None):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self._names = names
        common = dict(bias=bias, sequence_parallel=sequence_parallel, init=init, dtype=dtype, device=device)
        fc_in = ColumnParallelLinear(hidden, ffn, mesh, input_cache=input_cache, name=f"{name}.{names[0]}", **common)
        fc_out = RowParallelLinear(ffn, hidden, mesh, name=f"{name}.{names[1]}", **common)
        self.add_module(names[0], fc_in)
        self.add_module(names[1], fc_out)
        self.dropout = nn.Dropout(dropout)
        self._sequence_parallel, self._rng = sequence_parallel, tp_random.tracker(mesh)

    @property
    def column(self) -> ColumnParallelLinear:
        return self._modules[self._names[0]]

    @property
    def row(self) -> RowParallelLinear:
        return self._modules[self._names[1]]

    @classmethod
    def from_module(cls, mlp: nn.Module, mesh, *, names=("fc_in", "fc_out"), approximate: str = "tanh",
                    sequence_parallel: bool = False, input_cache: InputCache | None = None,
                    name: str = "ParallelMLP") -> ParallelMLP:
        """Slice an existing MLP whose two linear layers are ``mlp.<names[0]>`` and ``mlp.<names[1]>``."""
        src_in, src_out = getattr(mlp, names[0]), getattr(mlp, names[1])
        drop = getattr(mlp, "dropout", None)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.approximate, layer._names = approximate, names
        common = dict(sequence_parallel=sequence_parallel)
        layer.add_module(names[0], ColumnParallelLinear.from_linear(src_in, mesh, input_cache=input_cache,
                                                                    name=f"{name}.{names[0]}", **common))
        layer.add_module(names[1], RowParallelLinear.from_linear(src_out, mesh, name=f"{name}.{names[1]}", **common))
        layer.dropout = nn.Dropout(drop.p if isinstance(drop, nn.Dropout) else 0.0)
        layer._sequence_parallel, layer._rng = sequence_parallel, tp_random.tracker(mesh)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.column.forward_no_bias(x)  # [b, s, h] @ [h, ffn/t] -> Z [b, s, ffn/t] (bias added in the fused op)
        y = self.row.forward_gelu(z, self.column.bias, self.approximate)  # GeLU(Z + a) @ [ffn/t, h] -> [b, s, h]
        if self._sequence_parallel and self.training and self.dropout.p > 0:
            with self._rng.fork(y.device):  # y is this rank's [b, s/t, h] slice: its own mask
                return self.dropout(y)
        return self.dropout(y)  # y is replicated: the same mask on every TP rank


def _check_heads(name: str, n_head: int, n_kv_head: int, t: int) -> None:
    if n_head % t:
        raise ValueError(f"{name}: {n_head} attention heads are not divisible by the tensor-parallel degree "
                         f"tp={t}; choose a tp that divides {n_head}")
    if n_kv_head % t:
        raise ValueError(f"{name}: {n_kv_head} key/value heads are not divisible by the tensor-parallel degree "
                         f"tp={t} (grouped-query attention keeps whole KV groups per rank); choose a tp that "
                         f"divides {n_kv_head}")
    if n_head % n_kv_head:
        raise ValueError(f"{name}: {n_head} heads are not a multiple of {n_kv_head} key/value heads")


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with the heads split over the TP ranks: rank r computes heads
    [r·a/t, (r+1)·a/t) (and KV heads [r·a_kv/t, ...)) start to finish, and the row-parallel output
    projection sums the ranks' contributions."""

    def __init__(self, hidden: int, n_head: int, mesh, *, n_kv_head: int | None = None, head_dim: int | None = None,
                 bias: bool = True, key_bias: bool = False, dropout: float = 0.0, sequence_parallel: bool = False,
                 name: str = "ParallelSelfAttention", init: bool = True, dtype=None, device=None):
        super().__init__()
        t = mesh.tp_group.size
        n_kv_head = n_kv_head or n_head
        _check_heads(name, n_head, n_kv_head, t)
        self.head_dim = head_dim or hidden // n_head
        self.local_heads, self.local_kv_heads = n_head // t, n_kv_head // t
        self.dropout, self._rng = dropout, tp_random.tracker(mesh)
        cache = self._input_cache = InputCache()  # one f (or sequence all-gather) for q, k and v
        d = self.head_dim
        col = dict(sequence_parallel=sequence_parallel, input_cache=cache, init=init, dtype=dtype, device=device)
        self.q_proj = ColumnParallelLinear(hidden, n_head * d, mesh, bias=bias, name=f"{name}.q_proj", **col)
        self.k_proj = ColumnParallelLinear(hidden, n_kv_head * d, mesh, bias=key_bias, name=f"{name}.k_proj", **col)
        self.v_proj = ColumnParallelLinear(hidden, n_kv_head * d, mesh, bias=bias, name=f"{name}.v_proj", **col)
        self.o_proj = RowParallelLinear(n_head * d, hidden, mesh, bias=bias, sequence_parallel=sequence_parallel,
                                        name=f"{name}.o_proj", init=init, dtype=dtype, device=device)

    @classmethod
    def from_module(cls, attn: nn.Module, mesh, *, n_head: int | None = None, n_kv_head: int | None = None,
                    sequence_parallel: bool = False, name: str = "ParallelSelfAttention") -> ParallelSelfAttention:
        """Slice a causal attention module with q_proj, k_proj, v_proj and o_proj linear layers (the built-in
        GPT's CausalSelfAttention); head counts default to the widths over ``attn.head_dim``."""
        t = mesh.tp_group.size
        if n_head is None:
            n_head = attn.q_proj.out_features // attn.head_dim
            n_kv_head = n_kv_head or attn.k_proj.out_features // attn.head_dim
        n_kv_head = n_kv_head or n_head
        _check_heads(name, n_head, n_kv_head, t)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.head_dim = attn.q_proj.out_features // n_head
        layer.local_heads, layer.local_kv_heads = n_head // t, n_kv_head // t
        layer.dropout, layer._rng = float(getattr(attn, "dropout", 0.0) or 0.0), tp_random.tracker(mesh)
        cache = layer._input_cache = InputCache()
        for proj in ("q_proj", "k_proj", "v_proj"):
            setattr(layer, proj, ColumnParallelLinear.from_linear(getattr(attn, proj), mesh, input_cache=cache,
                                                                  sequence_parallel=sequence_parallel,
                                                                  name=f"{name}.{proj}"))
        layer.o_proj = RowParallelLinear.from_linear(attn.o_proj, mesh, sequence_parallel=sequence_parallel,
                                                     name=f"{name}.o_proj")
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        # One fused function for q, k and v: one f (or sequence all-gather) for all three, and in backward
        # one reduction of the input gradient, overlapped with their three weight gradients.
        q, k, v = column_parallel_group((self.q_proj, self.k_proj, self.v_proj), x)
        b, s = q.shape[:2]  # [b, s, h] @ [h, a/t·d] -> [b, s, a/t·d] (s: the full sequence, also with SP)
        q = q.view(b, s, self.local_heads, d).transpose(1, 2)  # [b, a/t, s, d]
        k = k.view(b, s, self.local_kv_heads, d).transpose(1, 2)
        v = v.view(b, s, self.local_kv_heads, d).transpose(1, 2)
        if self.local_kv_heads != self.local_heads:  # GQA: each local KV head serves its local Q group
            rep = self.local_heads // self.local_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if self.training and self.dropout > 0:
            with self._rng.fork(q.device):  # dropout on this rank's heads: its own mask
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))  # [b, s, a/t·d] @ [a/t·d, h] -> [b, s, h]
