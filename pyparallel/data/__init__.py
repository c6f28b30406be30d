"""A small text corpus shipped with the package, byte-level tokens, and deterministic batches.

Byte-level tokens (vocabulary 256) need no tokenizer download; ``batches`` draws windows from the
token stream with a seeded generator, so step k's batch is the same on every run, rank and layout —
which is what makes resumed and re-laid-out runs comparable bit for bit.

Splitting a global batch over the mesh (``shard_batch``, ``microbatches``), the global token count of a
causal-LM loss (``global_token_count``) and averaging a logged number over the data-parallel replicas
(``dp_mean``) live in ``split.py``.
"""

from __future__ import annotations

from importlib import resources

import torch

from pyparallel.data.split import dp_mean, dp_slice, global_token_count, microbatches, shard_batch  # noqa: F401

VOCAB_SIZE = 256


def load_text(path: str | None = None) -> str:
    """The user's text file, or the corpus shipped in pyparallel/data/corpus.txt."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return f.read()
    return resources.files("pyparallel.data").joinpath("corpus.txt").read_text(encoding="utf-8")


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int = 0):
    """Inputs and next-token targets, each [batch_size, seq_len], for global step ``step``."""
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"the text has {tokens.numel()} tokens; it needs more than seq_len + 1 = {seq_len + 1}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=gen)
    rows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
