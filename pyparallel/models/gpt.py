"""The built-in GPT that tests, benchmarks and examples share.

A decoder-only transformer in the GPT-2 layout (Radford et al. 2019; sizes as in nanoGPT): learned
token and position embeddings, pre-LayerNorm blocks of causal self-attention and a GeLU MLP, a final
LayerNorm and an LM head tied to the token embedding. Two departures that make parallelisation plain:

* Q, K and V are separate Linear layers (``q_proj``, ``k_proj``, ``v_proj``) so tensor parallelism can
  split each by heads without re-striding a fused QKV matrix; ``n_kv_head < n_head`` gives grouped-query
  attention (Ainslie et al. 2023).
* Head counts are derived from the layer widths at run time (width // head_dim), so a column-split
  projection that holds h/t heads needs no attribute patched.

Initialisation is GPT-2's (N(0, 0.02), residual projections scaled by 1/sqrt(2·n_layer)), each module
drawn from its own generator seeded by ``seed`` and the module's name (:meth:`GPT.init_module`). The values
are therefore independent of the device, the number of processes and the order of initialisation: a GPT
built on the meta device and materialised one module at a time on each rank (``pyparallel.materialize``
uses ``init_module`` by default) holds exactly the slices of ``GPT(cfg, seed)`` built whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from pyparallel.materialize import seed_of


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    vocab_size: int = 256
    block_size: int = 64
    n_kv_head: int | None = None  # None: as many as n_head (plain multi-head attention)
    ffn_mult: int = 4
    bias: bool = True
    dropout: float = 0.0
    tie_embeddings: bool = True
    gelu_approximate: str = "tanh"  # GPT-2 uses the tanh approximation

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self) -> GPTConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.kv_heads})")
        return self


PRESETS: dict[str, GPTConfig] = {
    # Test- and CPU-sized.
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64),
    "small-test": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=128),
    "bench": GPTConfig(n_layer=4, n_head=8, n_embd=256, vocab_size=2048, block_size=128),
    # GPT-2 family (nanoGPT's configurations; vocabulary 50257, context 1024).
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280, vocab_size=50257, block_size=1024),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024),
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """A preset by name, with fields overridden (``gpt_config("tiny", n_layer=5)``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides).validate()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=cfg.bias)
        # No key bias: softmax is invariant to adding q·b_k to every score of a row, so its gradient is
        # analytically zero and only rounding noise remains, which Adam would amplify into drift.
        self.k_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # [b, s, h] @ [h, heads*d] -> [b, heads, s, d]; heads is whatever this rank holds.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each KV head serves a group of Q heads
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        # [b, heads, s, d] -> [b, s, heads*d] @ [heads*d, h] -> [b, s, h]
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.n_embd, cfg.ffn_mult * cfg.n_embd, bias=cfg.bias)
        self.fc_out = nn.Linear(cfg.ffn_mult * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.approximate = cfg.gelu_approximate
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [b, s, h] -> [b, s, 4h] -> [b, s, h]
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token + position embedding: the first pipeline stage."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        pos = torch.arange(s, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Head(nn.Module):
    """Final LayerNorm + LM head: the last pipeline stage. ``lm_head.weight`` is tied to ``wte``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # [b, s, h] @ [h, v] -> [b, s, v]


class GPT(nn.Module):
    """``GPT(cfg, seed)``; ``forward(idx, targets=None)`` returns logits, or the mean cross-entropy loss
    over all target tokens when ``targets`` is given (targets of -100 are ignored)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = cfg.validate()
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight
        self.seed = seed
        if not self.embed.wte.weight.is_meta:  # on meta there is nothing to fill (materialize does it later)
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Every module's :meth:`init_module`, each parameter filled by the first module that holds it (the
        tied LM head is the token embedding's)."""
        if seed is not None:
            self.seed = seed
        seen: set[int] = set()
        for name, module in self.named_modules():
            own = [p for p in module._parameters.values() if p is not None and id(p) not in seen]
            seen.update(id(p) for p in own)
            if own:
                self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """GPT-2's initialisation of one module's own parameters (``init(name, module)`` of
        ``pyparallel.materialize``): biases 0, LayerNorm weights 1, other weights N(0, 0.02), the residual
        projections (``o_proj``, ``fc_out``) N(0, 0.02 / sqrt(2·n_layer)) (Radford et al. 2019), drawn from a
        CPU generator seeded by ``seed_of(name, seed)`` whatever the device."""
        gen = torch.Generator().manual_seed(seed_of(name, self.seed))
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith(("o_proj", "fc_out")) else 0.02
        for attr, p in module._parameters.items():
            if p is None:
                continue
            if attr == "bias":
                p.zero_()
            elif isinstance(module, nn.LayerNorm):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        # Low precision is raised to float32 for the softmax; float64 stays float64 (as the TP loss does).
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def num_params(self) -> int:
        """Unique parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())


def synthetic_batch(cfg: GPTConfig, batch: int, seq: int | None = None, seed: int = 0):
    """Deterministic random tokens and next-token targets: ``(idx, targets)`` of shape [batch, seq]."""
    seq = seq or cfg.block_size
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
