"""Built-in tensor-parallel plans: which module of a known model becomes which parallel layer, which sizes
must divide by t, and which attributes of attention modules change with the number of local heads.

A plan maps module-name patterns (``fnmatch``, e.g. ``"*layers.*.self_attn.q_proj"``) to a style:

======================  ============================================================================
``"column"``            ColumnParallelLinear (replicated input, output split by features)
``"column_gather"``     the same with the output all-gathered (replicated output)
``"row"``               RowParallelLinear (input split by features, output all-reduced)
``"qkv"``               a fused [q; k; v] column layer (GPT-2's ``c_attn``): each of q, k, v split by heads
``"attention"``         an attention module with q_proj/k_proj/v_proj/o_proj and ``head_dim`` ->
                        ParallelSelfAttention (causal; the built-in GPT's, also under sequence parallelism)
``"gelu_mlp"``          an MLP with two linear layers around a GeLU -> ParallelMLP with the fused GeLU matmul
``"vocab"``             VocabParallelEmbedding
``"vocab_head"``        LM head split by vocabulary (sharing the embedding's shard when tied) + the
                        vocabulary-parallel cross-entropy
``"replicate"``         left as it is (excludes a module a broader pattern matched)
======================  ============================================================================

Built-in plans: the built-in GPT (``pyparallel.models.gpt``), Hugging Face GPT-2 and the LLaMA family
(q/k/v/gate/up column, o/down row; rotary embeddings act per head and need no change).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

STYLES = ("column", "column_gather", "row", "qkv", "attention", "gelu_mlp", "vocab", "vocab_head", "replicate")

GPT_PLAN = {
    "embed.wte": "vocab",
    "blocks.*.attn": "attention",  # q_proj/k_proj/v_proj column, o_proj row, split by heads
    "blocks.*.mlp": "gelu_mlp",  # fc_in column, fc_out row, GeLU fused into fc_out's matmul
    "head.lm_head": "vocab_head",
}

GPT2_PLAN = {
    "*wte": "vocab",
    "*h.*.attn.c_attn": "qkv",
    "*h.*.attn.c_proj": "row",
    "*h.*.mlp": "gelu_mlp",  # c_fc column, c_proj row
    "lm_head": "vocab_head",
}

LLAMA_PLAN = {
    "*embed_tokens": "vocab",
    "*layers.*.self_attn.q_proj": "column",
    "*layers.*.self_attn.k_proj": "column",
    "*layers.*.self_attn.v_proj": "column",
    "*layers.*.self_attn.o_proj": "row",
    "*layers.*.mlp.gate_proj": "column",
    "*layers.*.mlp.up_proj": "column",
    "*layers.*.mlp.down_proj": "row",
    "lm_head": "vocab_head",
}

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


@dataclass
class ModelPlan:
    """A plan plus what parallelize needs to know about the model family."""

    family: str  # "gpt" (built-in), "gpt2", "llama" or "custom"
    styles: dict[str, str]
    mlp_names: tuple[str, str] = ("fc_in", "fc_out")
    gelu: str = "tanh"
    sizes: dict[str, int] = field(default_factory=dict)  # what must divide by t, by name


def _hf_config(model: nn.Module):
    return getattr(model, "config", None)


def detect(model: nn.Module) -> ModelPlan | None:
    """The built-in plan for ``model``, or None when the model is not one we know."""
    from pyparallel.models.gpt import GPT

    if isinstance(model, GPT):
        c = model.config
        return ModelPlan("gpt", dict(GPT_PLAN), ("fc_in", "fc_out"), c.gelu_approximate, {
            "n_head (attention heads)": c.n_head, "n_kv_head (key/value heads)": c.kv_heads,
            "ffn width (ffn_mult * n_embd)": c.ffn_mult * c.n_embd, "vocab_size": c.vocab_size})
    cfg = _hf_config(model)
    kind = getattr(cfg, "model_type", None)
    if kind == "gpt2":
        from pyparallel.tensor_parallel.blocks import _GELU_BY_NAME

        act = cfg.activation_function
        if act not in _GELU_BY_NAME:
            raise ValueError(f"GPT-2 plan: activation_function {act!r} is not a GeLU the fused MLP supports "
                             f"({sorted(_GELU_BY_NAME)}); pass a plan with 'column'/'row' for c_fc/c_proj")
        inner = cfg.n_inner or 4 * cfg.hidden_size
        return ModelPlan("gpt2", dict(GPT2_PLAN), ("c_fc", "c_proj"), _GELU_BY_NAME[act], {
            "n_head (attention heads)": cfg.n_head, "n_embd (hidden size)": cfg.hidden_size,
            "n_inner (MLP width)": inner, "vocab_size": cfg.vocab_size})
    if kind in LLAMA_FAMILY:
        return ModelPlan("llama", dict(LLAMA_PLAN), sizes={
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size})
    return None


def check_sizes(plan: ModelPlan, t: int) -> None:
    """ValueError naming every size of the model that t does not divide."""
    bad = [f"{name} = {value}" for name, value in plan.sizes.items() if value % t]
    if bad:
        raise ValueError(f"tensor parallelism with tp={t} needs these sizes of the {plan.family} model to be "
                         f"divisible by {t}: {', '.join(bad)}; choose a tp that divides them")


# -------------------------------------------------------------------------- attention attribute fixes
# What each attention class reads at forward time that depends on the number of heads it holds
# (transformers 5.x): GPT2Attention splits c_attn's output with split_size (= embed_dim) and keeps
# num_heads / embed_dim; LlamaAttention views with -1 heads and keeps head_dim and
# num_key_value_groups (= heads / kv_heads, unchanged by an even split), so it needs nothing.

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "split_size",
               "embed_dim", "all_head_size")


def _fix_gpt2_attention(module: nn.Module, t: int, name: str) -> None:
    if getattr(module, "is_cross_attention", False):
        raise ValueError(f"{name}: cross-attention GPT2Attention is not supported by the tensor-parallel plan")
    module.num_heads //= t
    module.embed_dim //= t
    module.split_size //= t


ATTENTION_FIXES = {
    "GPT2Attention": _fix_gpt2_attention,
    "LlamaAttention": None,
    "MistralAttention": None,
    "Qwen2Attention": None,
    "CausalSelfAttention": None,  # pyparallel.models.gpt: heads derived from the layer widths
}


def check_attention(module: nn.Module, name: str, t: int, fixes: dict) -> None:
    """Refuse a module that holds column-split q/k/v projections and head-count attributes we cannot fix."""
    cls = type(module).__name__
    if t == 1 or cls in fixes:
        return
    found = [a for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)]
    if found:
        raise ValueError(f"{name or 'the model'} ({cls}) holds column-split projections and head-count "
                         f"attributes {found} that pyparallel does not know how to adjust for tp={t}; pass "
                         f"attention_fixes={{'{cls}': fn(module, tp, name)}} to parallelize, or a plan that "
                         f"leaves this module replicated")
