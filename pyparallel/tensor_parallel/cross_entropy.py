"""Cross-entropy over vocabulary-split logits, without gathering them (Megatron-LM, Shoeybi et al. 2019, §3:
"we fuse the output of the parallel GEMM with the cross entropy loss").

Rank r holds logits[..., r·V/t : (r+1)·V/t]. For N = b·s tokens the loss
``log(sum_v exp(x_v - m)) - (x_target - m)`` needs only three per-token scalars from the group: the
max ``m`` (all-reduce max), the sum of exponentials and the target's logit (one all-reduce of both,
stacked, since both are plain sums). Each rank sends O(N) numbers instead of the N·V/t it would send to
gather the logits. Backward is local: ``softmax - onehot(target)`` on this rank's vocabulary slice.

With a padded vocabulary (Megatron's ``make-vocab-size-divisible-by``) ``vocab_size`` names the real one:
the columns past it are set to -inf before the max, so they add nothing to the sum of exponentials, never
win, and get a zero gradient -- also when something between the head and the loss (Gemma 2's final
soft-capping) turned the head's own -inf into a finite number.
"""

from __future__ import annotations

import torch

from pyparallel import comm
from pyparallel.data.tokens import check_token_ids


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, vocab_size):
        # logits [N, V/t] (computed in fp32, or fp64 for fp64), target [N] of global token ids
        x = logits if logits.dtype == torch.float64 else logits.float()
        v_local = x.shape[-1]
        start = group.rank * v_local
        if vocab_size is not None and start + v_local > vocab_size:  # padded columns on this rank
            pad = torch.arange(start, start + v_local, device=x.device) >= vocab_size
            x = x.masked_fill(pad, float("-inf"))
        m = x.max(dim=-1).values
        comm.all_reduce(m, group, op="max")  # [N]: the global max, for a stable exp
        shifted = x - m.unsqueeze(-1)
        exp = shifted.exp()
        mine = (target >= start) & (target < start + v_local)
        local_t = (target - start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        stats = torch.stack([exp.sum(-1), picked])  # [2, N]: sum of exp and target logit (0 off-rank)
        comm.all_reduce(stats, group)
        sum_exp, target_logit = stats[0], stats[1]
        valid = target != ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, mine & valid, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, hit, valid = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d x = softmax - onehot(target), on this rank's slice
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= hit.to(grad.dtype)
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: comm.Group, *,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 vocab_size: int | None = None) -> torch.Tensor:
    """``F.cross_entropy`` of logits split by vocabulary over ``group`` (rank r holds slice r).

    logits [..., V/t], target [...] of global token ids; ``reduction`` is "mean" (over targets that are not
    ``ignore_index``), "sum" or "none". ``vocab_size``: the real vocabulary when the split one is padded
    (columns from it on are excluded); None: every column is a token. A target that is neither
    ``ignore_index`` nor in ``[0, vocab_size)`` is refused before any collective, as one process's
    IndexError: no rank's slice holds it, so it would be read as a logit of 0. On the CPU a ValueError; on
    an accelerator a device-side assert without a host sync (``data.tokens.check_token_ids``)."""
    vocab = vocab_size if vocab_size is not None else logits.shape[-1] * group.size
    check_token_ids(target, vocab, "vocab_parallel_cross_entropy: target", ignore_index=ignore_index)
    return _cross_entropy(logits, target, group, ignore_index, reduction, vocab_size)


def _cross_entropy(logits, target, group, ignore_index, reduction, vocab_size):
    """:func:`vocab_parallel_cross_entropy` once its targets are checked."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on the "
                         f"leading (token) dimensions")
    flat = logits.reshape(-1, logits.shape[-1])
    loss = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), group, ignore_index, vocab_size)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
