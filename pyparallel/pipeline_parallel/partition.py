"""Split a model into a list of blocks and the blocks into pipeline chunks.

A pipeline runs a *sequence* of blocks, each taking one tensor and returning one tensor; the loss
function takes the last block's output and the targets. ``to_blocks`` knows three shapes of model:

* the built-in GPT: ``[embed, *blocks, head]`` with token cross-entropy as the loss;
* a Hugging Face causal LM (LLaMA, GPT-2, ...): embedding, decoder layers, final norm + LM head (see
  ``adapters.py``), with the same loss (on aligned targets: ``labels.py`` shifts Hugging Face's
  ``labels=`` before they get here);
* an ``nn.Sequential`` or a list of modules: its children, with a loss the caller supplies.

Chunks are contiguous runs of blocks, so the embedding is on the first stage and the head on the last.
By default they are balanced by parameter count (GPipe, Huang et al. 2019, balances by a cost per
layer in the same way); ``boundaries`` gives them explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the target tokens (-100 ignored), as ``GPT.forward(idx, targets)``."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=-100)


def default_count(targets: torch.Tensor) -> int:
    """How many terms ``loss_fn`` averages over: tokens not equal to -100 for integer targets, elements
    for float targets (any count proportional to the number of terms weighs micro-batches correctly)."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex:
        return targets.numel()
    return int((targets != -100).sum())


def to_blocks(model) -> tuple[list[nn.Module], Callable | None]:
    """``(blocks, default_loss_fn)`` for a supported model (see the module docstring)."""
    blocks, loss = _blocks(model)
    if isinstance(model, nn.Module) and not isinstance(model, (nn.Sequential, nn.ModuleList)):
        # The model's own names of every tensor, so that checkpoints of a stage use them (not block names).
        names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        for b in blocks:
            b.__dict__["_pyparallel_names"] = names
    return blocks, loss


def _blocks(model) -> tuple[list[nn.Module], Callable | None]:
    from pyparallel.models.gpt import GPT

    if isinstance(model, GPT):
        return [model.embed, *model.blocks, model.head], token_cross_entropy
    if isinstance(model, nn.Sequential):
        return list(model.children()), None
    if isinstance(model, (list, tuple, nn.ModuleList)):
        blocks = list(model)
        for i, b in enumerate(blocks):
            if not isinstance(b, nn.Module):
                raise ValueError(f"block {i} of the pipeline is a {type(b).__name__}, not an nn.Module")
        return blocks, None
    from pyparallel.pipeline_parallel import adapters

    blocks = adapters.hf_blocks(model)
    if blocks is not None:
        return blocks, token_cross_entropy
    raise ValueError(f"cannot split a {type(model).__name__} into pipeline blocks: pass the built-in GPT, a "
                     f"Hugging Face causal LM (LLaMA, GPT-2), an nn.Sequential or a list of modules")


def token_vocab(blocks: Sequence[nn.Module]) -> tuple[int | None, int | None, int | None]:
    """``(input ids, target ids, positions)``: the vocabulary of a language model's token embedding, of its
    LM head, and its number of learned positions, read from the built-in GPT's or a Hugging Face model's
    first and last block; None where there is no such layer. An embedding split by vocabulary still knows
    the whole vocabulary; a split LM head does not (``ParallelModel`` checks targets against the real
    one). The batch is checked against them on every stage (``PipelineParallel._validate``), since the
    lookups and the loss run on one stage each."""
    from pyparallel.models.gpt import Embedding, Head
    from pyparallel.pipeline_parallel.adapters import HFEmbedding, HFHead
    from pyparallel.tensor_parallel.layers import VocabParallelEmbedding

    def rows(m):
        return m.num_embeddings if isinstance(m, (nn.Embedding, VocabParallelEmbedding)) else None

    first, last = blocks[0], blocks[-1]
    ids = positions = out = None
    if isinstance(first, Embedding):
        ids, positions = rows(first.wte), rows(first.wpe)
    elif isinstance(first, HFEmbedding):
        ids, positions = rows(first.tokens), rows(first.positions)
    head = last.lm_head if isinstance(last, (Head, HFHead)) else None
    if isinstance(head, nn.Linear):
        out = head.out_features
    return ids, out, positions


def block_costs(blocks: Sequence[nn.Module]) -> list[int]:
    """Parameters per block (a parameter shared by two blocks counts in both: both compute with it)."""
    return [sum(p.numel() for p in b.parameters()) for b in blocks]


def balance(costs: Sequence[int], n: int) -> list[int]:
    """Boundaries ``[0, b1, ..., n_blocks]`` of ``n`` contiguous non-empty chunks minimising the largest
    chunk cost, then the sum of squared chunk costs (the linear-partition dynamic programme;
    O(blocks^2 x chunks), deterministic so every rank computes the same split)."""
    k = len(costs)
    if n > k:
        raise ValueError(f"cannot make {n} chunks from {k} blocks")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[j][i]: (bottleneck, sum of squares) splitting blocks [0, i) into j chunks; cut: its last cut.
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = (0, 0)
    for j in range(1, n + 1):
        for i in range(j, k - (n - j) + 1):
            for s in range(j - 1, i):
                w = prefix[i] - prefix[s]
                cand = (max(best[j - 1][s][0], w), best[j - 1][s][1] + w * w)
                if cand < best[j][i]:
                    best[j][i], cut[j][i] = cand, s
    bounds, i = [k], k
    for j in range(n, 0, -1):
        i = cut[j][i]
        bounds.append(i)
    return bounds[::-1]


def check_boundaries(boundaries, n_blocks: int, n_chunks: int) -> list[int]:
    b = [int(x) for x in boundaries]
    if len(b) != n_chunks + 1 or b[0] != 0 or b[-1] != n_blocks or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"boundaries {list(boundaries)} must be {n_chunks + 1} strictly increasing block "
                         f"indices from 0 to {n_blocks} (one chunk per pipeline stage x virtual stage)")
    return b


def plan_chunks(blocks: Sequence[nn.Module], p: int, v: int, boundaries=None) -> list[int]:
    """Boundaries of the ``p * v`` chunks; ValueError when there are more chunks than blocks."""
    n_chunks = p * v
    if n_chunks > len(blocks):
        what = f"{p} pipeline stages" + (f" x {v} virtual stages = {n_chunks} chunks" if v > 1 else "")
        raise ValueError(f"{what}, but the model has only {len(blocks)} blocks; use at most "
                         f"{len(blocks) // v} stages or split the model finer")
    if boundaries is not None:
        return check_boundaries(boundaries, len(blocks), n_chunks)
    return balance(block_costs(blocks), n_chunks)


def tied_parameters(blocks: Sequence[nn.Module], bounds: Sequence[int], p: int,
                    stage_of: Callable[[int], int] | None = None) -> list[tuple]:
    """Parameters shared by chunks on different ranks (the GPT's wte / lm_head):
    ``[(name, stages, parameter)]``.

    ``name`` is the parameter's name inside the first chunk that holds it (``"0.wte.weight"``: block 0
    of that chunk) and ``stages`` the sorted pipeline ranks that hold a copy (chunk ``c`` on rank
    ``stage_of(c)``, by default ``c % p``; under ZBV the GPT's first and last chunk share rank 0, so its
    tie needs no group). Sharing within one rank
    needs nothing: autograd sums into the one Parameter."""
    holders: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for c in range(len(bounds) - 1):
        chunk = nn.ModuleList(blocks[bounds[c]:bounds[c + 1]])
        for name, prm in chunk.named_parameters():
            holders.setdefault(id(prm), []).append(c)
            names.setdefault(id(prm), f"chunk{c}.{name}")
            params[id(prm)] = prm
    out = []
    for key, chunks in holders.items():
        stages = tuple(sorted({(stage_of(c) if stage_of else c % p) for c in chunks}))
        if len(stages) > 1:
            out.append((names[key], stages, params[key]))
    return out
