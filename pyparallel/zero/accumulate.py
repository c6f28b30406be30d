"""Weight-gradient accumulation fusion: a Linear's or an Embedding's weight gradient is added straight into
the engine's flat gradient buffer.

Autograd computes a layer's weight gradient as a new full-size tensor and then adds it into ``.grad`` (here
a view of the engine's flat buffer, ``ShardEngine._attach_grads``): for a moment the matrix's gradient
exists twice. For the vocabulary matrix that moment is a rank's peak: at GPT-2's width the embedding / LM
head is 50304 x 768, 147 MiB of gradient beside the 147 MiB already accumulated. Megatron-LM's
``gradient_accumulation_fusion`` removes it for its linear layers by accumulating ``dY^T X`` into the
parameter's ``main_grad`` inside the GEMM (``beta = 1``); the same here, from plain torch:

* Linear: ``buffer.addmm_(dY^T, X)``;
* Embedding: ``buffer.index_add_(0, ids, dY)`` (torch's own CPU backward of an embedding is an
  ``index_add_`` into a zeroed V x h tensor), skipping the ``padding_idx`` rows as torch does.

The weight's gradient returned to autograd is then a zero that occupies no memory (a 0-d zero expanded to
the weight's shape), so ``AccumulateGrad`` still runs in autograd's own order, adds nothing in place, and
fires the engine's post-accumulate hook exactly as before: reductions launch at the same moments. Where the
buffer cannot take the gradient (no ``.grad`` view of the weight's dtype: mixed precision accumulating in
fp32), the layer computes the gradient as torch does.

Only the layers' own classes are fused (``type(m) is nn.Linear`` / ``nn.Embedding``; the tensor-parallel
layers have their own backward), embeddings without ``max_norm``, ``scale_grad_by_freq`` or ``sparse``.
The sums are the same products added in another order (into the running sum rather than into zero), so
results equal the unfused ones to rounding, not bit for bit. Not for the zero-bubble schedules: their B
pass runs a layer's backward for the input gradient only, and a side effect on the weight buffer there
would be counted again by W (``pipeline_parallel.split``).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F


def _into(weight: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
    """The buffer view to accumulate ``weight``'s gradient into, or None (compute it as torch does)."""
    buf = weight.grad
    if buf is None or buf.dtype != grad.dtype or buf.shape != weight.shape or torch.is_grad_enabled():
        return None
    return buf


def _nothing(weight: torch.Tensor) -> torch.Tensor:
    """A zero gradient of ``weight``'s shape that holds one element."""
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, param):
        ctx.param, ctx.has_bias = param, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        dw = db = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            buf = _into(ctx.param, dy)
            if buf is None:
                dw = dy2.t().mm(x2)
            else:
                buf.addmm_(dy2.t(), x2)
                dw = _nothing(weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx, param):
        ctx.param, ctx.padding_idx = param, padding_idx
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.param
        flat_ids = ids.reshape(-1)
        rows = dy.reshape(-1, dy.shape[-1])
        if ctx.padding_idx is not None:  # torch leaves the padding row's gradient zero
            keep = flat_ids != ctx.padding_idx
            flat_ids, rows = flat_ids[keep], rows[keep]
        buf = _into(weight, dy)
        if buf is None:
            dw = torch.zeros(weight.shape, dtype=dy.dtype, device=dy.device)
            dw.index_add_(0, flat_ids, rows)
            return None, dw, None, None
        buf.index_add_(0, flat_ids, rows)
        return None, _nothing(weight), None, None


def _linear_forward(self, x):
    return _Linear.apply(x, self.weight, self.bias, self.weight)


def _embedding_forward(self, ids):
    return _Embedding.apply(ids, self.weight, self.padding_idx, self.weight)


def fusable(module: nn.Module) -> bool:
    if type(module) is nn.Linear:
        return True
    return (type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq
            and not module.sparse)


def install(modules, trainable: set[int]) -> int:
    """Fuse the weight-gradient accumulation of every plain Linear / Embedding under ``modules`` whose
    weight is in ``trainable`` (ids of parameters the engine gives a same-dtype ``.grad`` buffer view);
    returns how many layers were fused. The layer's ``forward`` is replaced on the instance only."""
    count = 0
    for root in modules:
        for m in root.modules():
            if fusable(m) and id(m.weight) in trainable and m.weight.requires_grad:
                fwd = _linear_forward if type(m) is nn.Linear else _embedding_forward
                m.forward = types.MethodType(fwd, m)
                count += 1
    return count
