"""Token ids checked against a vocabulary on every rank that holds the batch (``check_token_ids``).

Used by the tensor-parallel embedding and loss, and on a whole batch (``check_batch_tokens``) by the
pipeline's and ``ParallelModel``'s checks before a step.
"""

from __future__ import annotations

import torch


def check_token_ids(ids: torch.Tensor, size: int, what: str, *, ignore_index: int | None = None,
                    shift: int = 0, host: bool = False) -> None:
    """Refuse token ids outside ``[0, size)`` (``ignore_index`` also allowed, for labels) with a ValueError
    that names the value, its position and the vocabulary, before the first collective.

    Why a check of our own where one process has its IndexError: split by vocabulary (tensor parallelism),
    no rank owns such an id, so the lookup or loss would take it as a zero embedding or a zero logit (an id
    in the padding rows too); split by layers (pipeline parallelism), the embedding and the loss run on one
    stage each, whose IndexError leaves the other stages waiting on a message that never comes. The check is
    local, and identical on every rank that holds the same batch (a TP group, the stages of a pipeline), so
    they all raise together. ``shift`` is added to the last coordinate of the reported position (labels
    shifted left by one: the loss reads ``labels[..., i + 1]`` as target ``i``).

    Cost: one min/max reduction (``torch.aminmax``); the position is looked for only on failure. On the CPU
    reading the two numbers is free. On an accelerator it is a host sync, which a layer's forward must not
    pay on every call (it stalls the queue), so there the check is ``torch._assert_async`` instead: no
    sync, and a bad id ends the job with a device-side assert at the next synchronisation, as one process's
    own embedding and cross-entropy kernels do on CUDA. ``host=True`` reads the numbers back on any device
    and raises the ValueError: for a whole batch checked once per step (``check_batch_tokens``), where one
    sync buys the error before any collective."""
    if ids.numel() == 0 or ids.device.type == "meta" or ids.is_floating_point() or ids.dtype == torch.bool:
        return  # nothing to read (meta) or not ids: F.embedding / the loss refuse such a tensor themselves
    x = ids if ignore_index is None else ids.masked_fill(ids == ignore_index, 0)
    lo, hi = torch.aminmax(x)
    if ids.device.type != "cpu" and not host:
        torch._assert_async((lo >= 0) & (hi < size), f"{what}: a token id is outside the vocabulary [0, {size})")
        return
    if int(lo) >= 0 and int(hi) < size:
        return
    pos = [int(i) for i in ((x < 0) | (x >= size)).nonzero()[0]]
    value = int(ids[tuple(pos)])
    if pos:
        pos[-1] += shift
    allowed = f"ignore_index ({ignore_index}) or " if ignore_index is not None else ""
    raise ValueError(f"{what} {value} at position {tuple(pos)} is outside the vocabulary of {size} tokens; it must "
                     f"be {allowed}a token id in [0, {size}) (check that the tokenizer and the model's vocab_size "
                     f"agree)")


def check_batch_tokens(inputs, targets, labels, ids: int | None, out: int | None) -> None:
    """A language model's batch, on any device a ValueError (one host sync per tensor off the CPU): input
    ids in ``[0, ids)``; Hugging Face ``labels`` (unshifted: ``labels[:, 0]`` is never a target) or else
    aligned ``targets`` in ``[0, out)`` or -100. None: that side is not checked."""
    if ids is not None:
        check_token_ids(inputs, ids, "input id", host=True)
    if out is None:
        return
    if labels is not None:
        check_token_ids(labels[:, 1:], out, "label", ignore_index=-100, shift=1, host=True)
    elif targets is not None:
        check_token_ids(targets, out, "target", ignore_index=-100, host=True)
