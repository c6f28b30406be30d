"""The two label conventions ``PipelineParallel.step`` and ``ParallelModel.step`` accept, and the attention
mask of a padded batch.

* **Aligned targets** (``step(inputs, targets)``): ``targets[:, t]`` is what the output at position t is
  scored against (already shifted for next-token prediction, -100 where nothing is scored). Any model.
* **Hugging Face labels** (``step(inputs, labels=...)``), for language models (the built-in GPT and
  Hugging Face causal LMs): unshifted, ``labels[:, t]`` is token t. The loss at position t is over
  ``labels[:, t + 1]`` and the last position scores nothing, exactly as ``ForCausalLMLoss`` shifts; -100
  is ignored. Padding is ignored only where the labels say -100 (as in Hugging Face, the attention mask
  does not mask the labels).

Both are reduced to aligned targets here, before any communication, so the engine has one path: its
loss is the mean over every non-ignored target token of the global batch (``engine.py``).
"""

from __future__ import annotations

import torch


def labels_to_targets(inputs: torch.Tensor, targets, labels, takes_labels: bool) -> torch.Tensor:
    """The targets aligned with the outputs: ``targets`` as given, or Hugging Face's ``labels`` shifted
    left by one with -100 appended (the loss at position t is over token t + 1, as ``ForCausalLMLoss``)."""
    if labels is None:
        if targets is None:
            raise ValueError("step needs targets (aligned with the outputs) or labels= (Hugging Face's "
                             "unshifted convention)")
        return targets
    if targets is not None:
        raise ValueError("pass either targets (already shifted) or labels= (unshifted, shifted inside), "
                         "not both")
    if not takes_labels:
        raise ValueError("labels= (shifted inside, for language models) needs the built-in GPT or a Hugging "
                         "Face causal LM; for other models pass targets aligned with the outputs")
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dim() != 2:
        what = f"shape {tuple(labels.shape)} ({labels.dtype})" if isinstance(labels, torch.Tensor) else \
            f"a {type(labels).__name__}"
        raise ValueError(f"labels must be an integer tensor [batch, seq] of token ids (-100 ignored), got {what}")
    if not isinstance(inputs, torch.Tensor) or tuple(labels.shape) != tuple(inputs.shape[:2]):
        raise ValueError(f"labels of shape {tuple(labels.shape)} must have the inputs' shape "
                         f"{tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else inputs!r}")
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)


def check_attention_mask(inputs: torch.Tensor, mask, takes_mask: bool) -> None:
    if mask is None:
        return
    if not takes_mask:
        raise ValueError("attention_mask= needs a Hugging Face causal LM (its decoder layers take the mask); "
                         "this model's blocks do not, and ignoring it would train on the padding")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != tuple(inputs.shape[:2]) \
            or inputs.dim() != 2:
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask must be [batch, seq] like the input ids {tuple(inputs.shape)} "
                         f"(1 = token, 0 = padding), got {got}")
