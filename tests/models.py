"""Small models and data shared by the strategy tests."""

import torch
import torch.nn as nn

from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch

TINY = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)


class Net(nn.Module):
    """The tiny built-in GPT, optionally with a parameter no step uses and a buffer the forward reads."""

    def __init__(self, unused: bool = False, buffer: bool = False, **cfg):
        super().__init__()
        self.gpt = GPT(gpt_config("tiny", **{**TINY, **cfg}), seed=0)
        if unused:
            self.unused = nn.Linear(3, 5)
            with torch.no_grad():
                gen = torch.Generator().manual_seed(5)
                for p in self.unused.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen))
        if buffer:
            self.register_buffer("calls", torch.zeros(()))
        self.has_buffer = buffer

    def forward(self, idx, targets):
        loss = self.gpt(idx, targets)
        if self.has_buffer:  # a buffer that changes every step and feeds the loss
            loss = loss * (1 + 0.01 * self.calls)
            self.calls += 1
        return loss


def batches(steps: int, batch: int, seq: int = 12, vocab: int = 64):
    cfg = gpt_config("tiny", **{**TINY, "vocab_size": vocab})
    return [synthetic_batch(cfg, batch, seq, seed=100 + s) for s in range(steps)]


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
