"""Compute time of one transformer layer on one GPU: GEMMs on an efficiency curve, elementwise work on HBM.

Why a curve: a GEMM of F floating-point operations does not run at a fixed fraction of peak. Hockney's
two-parameter model of pipelined hardware (Hockney & Jesshope, "Parallel Computers 2", 1988) gives its
time as (F + F_half) / r_inf: r_inf = peak · ``gemm_eff`` is the rate a very large GEMM reaches and F_half
the work that would run in the GEMM's fixed cost (launch, the first and last partial waves of thread
blocks, prologue and epilogue). Small per-GPU matrices (small hidden size, large tensor-parallel degree,
micro-batch 1) therefore run further below peak, which is what makes Narayanan et al. 2021's measured
throughput rise with model size (their table 1).

Why an elementwise term: LayerNorm, GeLU, dropout, residual adds, softmax and the cross-entropy move
bytes, not FLOPs. Each byte an activation occupies (the Korthikanti et al. 2022 counts of memory.py) is
written by one forward kernel and read by the next (2 passes), and in backward read again with the
incoming gradient while the outgoing gradient is written (3 passes): ``FWD_PASSES`` + ``BWD_PASSES`` = 5
passes over the stored activations per forward + backward, at the GPU's HBM bandwidth. The share
of these bytes not split by tensor parallelism (10·s·b·h without sequence parallelism) is what makes a
large TP degree cost compute efficiency on top of its communication.

All times are for one micro-batch of ``b`` sequences of ``s`` tokens on one tensor-parallel rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from pyparallel.planner.memory import DTYPE_BYTES, activation_bytes_per_layer

FWD_PASSES, BWD_PASSES = 2, 3  # HBM passes over the stored activations (see the module docstring)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds per layer per micro-batch: forward ``f``, backward split as the zero-bubble schedules
    split it into input gradient ``b_in`` and weight gradient ``w`` (Qi et al. 2023), and the extra
    forward work that recomputation adds to backward ``r``."""

    f: float
    b_in: float
    w: float
    r: float

    @property
    def total(self) -> float:
        return self.f + self.b_in + self.w + self.r


@dataclass(frozen=True)
class ComputeModel:
    """GEMM and elementwise times for a cluster: r_inf = ``peak`` · ``eff``, the half-performance size
    ``half`` (0: no size curve), HBM bytes per second ``hbm`` (0: elementwise work not modelled)."""

    peak: float
    eff: float
    half: float = 0.0
    hbm: float = 0.0

    @classmethod
    def for_cluster(cls, cluster, dtype: str, flat: float | None = None) -> ComputeModel:
        """The cluster's curve, or with ``flat`` (``--efficiency``) the single-efficiency model: every
        FLOP at ``flat`` · peak, no fixed GEMM cost, no elementwise or optimizer term."""
        peak = cluster.peak_flops(dtype)
        if flat is not None:
            return cls(peak, flat)
        return cls(peak, cluster.gemm_eff, cluster.gemm_half_dim, cluster.hbm_bw * 1e9)

    def gemm(self, flops: float, size: float = math.inf) -> float:
        """Seconds for compute-bound GEMM work of ``flops`` with reduction dimension ``size``."""
        if flops <= 0:
            return 0.0
        return flops / (self.peak * self.efficiency(size))

    def efficiency(self, size: float = math.inf) -> float:
        """Fraction of peak a GEMM with reduction dimension ``size`` reaches: gemm_eff · k / (k + k_half)
        (Hockney's half-performance length over the GEMM's inner loop: each output tile loops over k,
        then pays a fixed prologue and epilogue)."""
        if math.isinf(size) or self.half <= 0:
            return self.eff
        return self.eff * size / (size + self.half)

    def matmul(self, m: float, k: float, n: float, batch: float = 1, elem_bytes: int = 2,
               curve: bool = True) -> float:
        """Seconds of ``batch`` GEMMs [m, k] @ [k, n] on the roofline (Williams et al. 2009): the longer
        of the compute time (on the curve over the reduction dimension k when ``curve``) and the time to
        read both operands and write the result through HBM. The attention core's per-head GEMMs (batched
        over heads, k or n = head dimension) land on the memory side on A100."""
        compute = self.gemm(2 * m * k * n * batch, k if curve else math.inf)
        memory = self.stream(elem_bytes * batch * (m * k + k * n + m * n))
        return max(compute, memory)

    def stream(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through HBM (memory-bound elementwise work)."""
        return nbytes / self.hbm if self.hbm > 0 else 0.0


def layer_gemms(model, seq_len: int, micro_batch: int, tp: int) -> list[tuple[float, float, float]]:
    """(M, K, N) of each weight GEMM of one layer's forward on one TP rank (Megatron's split: QKV and the
    MLP up/gate projections by columns, the output and down projections by rows)."""
    m = micro_batch * seq_len  # tokens in the micro-batch: every GEMM's M
    h, f, q, kv_dim = model.hidden, model.ffn_dim, model.q_dim, model.kv_dim
    gemms = [(m, h, (q + 2 * kv_dim) / tp),  # [m, h] @ [h, (q + 2kv)/t]: Q, K, V
             (m, q / tp, h)]  # [m, q/t] @ [q/t, h]: attention output projection
    ups = 2 if model.gated_mlp else 1  # SwiGLU's gate and up projections
    gemms += [(m, h, f / tp)] * ups  # [m, h] @ [h, f/t]
    gemms.append((m, f / tp, h))  # [m, f/t] @ [f/t, h]: down projection
    return gemms


def attention_core_flops(model, seq_len: int, micro_batch: int, tp: int) -> float:
    """Forward FLOPs of Q·Kᵀ and softmax·V: 2 batched GEMMs of 2·b·s²·h/t each (Narayanan et al. 2021)."""
    return 4 * micro_batch * seq_len * seq_len * model.hidden / tp


def attention_core_seconds(cm: ComputeModel, model, seq_len: int, micro_batch: int, tp: int,
                           dtype: str) -> float:
    """Forward of the attention core: per head [s, d] @ [d, s] then [s, s] @ [s, d], batched over the
    b·a/t heads of a rank. Unfused, the s×s scores make the round trip through HBM (the roofline); fused
    (flash attention) they stay on chip, so only the FLOPs count."""
    d = model.head_size
    heads = micro_batch * model.heads / tp
    if model.fused_attention:
        return cm.gemm(attention_core_flops(model, seq_len, micro_batch, tp))
    w = DTYPE_BYTES[dtype]
    return (cm.matmul(seq_len, d, seq_len, heads, w, curve=False)
            + cm.matmul(seq_len, seq_len, d, heads, w, curve=False))


@lru_cache(maxsize=4096)
def layer_times(cm: ComputeModel, model, seq_len: int, micro_batch: int, tp: int, sequence_parallel: bool,
                recompute: str, dtype: str) -> LayerTimes:
    """Forward, backward (input and weight gradients) and recomputation seconds of one layer.

    Backward GEMMs are two per forward GEMM (input gradient and weight gradient) of the same size; the
    attention core has no weights, its backward is input gradient only: twice its forward unfused, 2.5×
    fused (flash attention recomputes Q·Kᵀ in backward). ``recompute`` "full" reruns the whole forward in
    backward, "selective" the attention core (and its softmax traffic) only.
    """
    w_bytes = DTYPE_BYTES[dtype]
    dense = dgrad = wgrad = 0.0
    for m, k, n in layer_gemms(model, seq_len, micro_batch, tp):
        dense += cm.matmul(m, k, n, 1, w_bytes)  # Y = X·W
        dgrad += cm.matmul(m, n, k, 1, w_bytes)  # dX = dY·Wᵀ: reduces over n
        wgrad += cm.matmul(k, m, n, 1, w_bytes)  # dW = Xᵀ·dY: reduces over the m tokens
    core = attention_core_seconds(cm, model, seq_len, micro_batch, tp, dtype)
    fused = model.fused_attention
    kept = "selective" if fused else "none"
    act = activation_bytes_per_layer(seq_len, micro_batch, model.hidden, model.heads, tp, sequence_parallel,
                                     kept, dtype)
    scores = 0.0 if fused else act - activation_bytes_per_layer(
        seq_len, micro_batch, model.hidden, model.heads, tp, sequence_parallel, "selective", dtype)
    elem = cm.stream(act)
    f = dense + core + FWD_PASSES * elem
    b_in = dgrad + core * (2.5 if fused else 2.0) + BWD_PASSES * elem
    w = wgrad
    r = {"full": f, "selective": 0.0 if fused else core + FWD_PASSES * cm.stream(scores)}.get(recompute, 0.0)
    return LayerTimes(f=f, b_in=b_in, w=w, r=r)


@lru_cache(maxsize=1024)
def head_times(cm: ComputeModel, model, seq_len: int, micro_batch: int, tp: int, dtype: str) -> LayerTimes:
    """The output layer on the last stage: logits [b·s, h] @ [h, V/t], its two backward GEMMs, and the
    fp32 softmax/cross-entropy over b·s·V/t logits (written, read, gradient written: 3 passes of 4 bytes).
    Never recomputed (Megatron-LM checkpoints transformer layers only)."""
    m, k, n, w = micro_batch * seq_len, model.hidden, model.vocab / tp, DTYPE_BYTES[dtype]
    loss = cm.stream(3 * 4 * micro_batch * seq_len * model.vocab / tp)
    return LayerTimes(f=cm.matmul(m, k, n, 1, w) + loss / 3, b_in=cm.matmul(m, n, k, 1, w) + 2 * loss / 3,
                      w=cm.matmul(k, m, n, 1, w), r=0.0)


def optimizer_seconds(cm: ComputeModel, shard_params: float, dtype: str) -> float:
    """The optimizer step on the GPU, memory-bound: mixed-precision Adam reads master, m, v (4 bytes
    each) and the gradient, writes master, m, v and the 16-bit weights: 28 bytes per parameter in bf16."""
    w = DTYPE_BYTES[dtype]
    return cm.stream(shard_params * (12 + w + 12 + w))
