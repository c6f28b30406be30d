"""Built-in tensor-parallel plans: which module of a known model becomes which parallel layer, which sizes
must divide by t, and which attributes of attention modules change with the number of local heads.

A plan maps module-name patterns (``fnmatch``, e.g. ``"*layers.*.self_attn.q_proj"``) to a style, by name
or as a :class:`~pyparallel.tensor_parallel.styles.Style` object; every style checks the module it gets and
refuses what it cannot split exactly (see :mod:`pyparallel.tensor_parallel.styles`):

======================  ============================================================================
``"column"``            ColumnParallelLinear (replicated input, output split by features); refused when
                        the parent module chunks, splits or slices the output
``"column_gather"``     the same with the output all-gathered (replicated output)
``"row"``               RowParallelLinear (input split by features, output all-reduced)
``"qkv"``               a fused [q; k; v] column layer of 3 equal sections (GPT-2's ``c_attn``), split by heads
``"fused_qkv"``         a fused [q; k; v] layer sized by the attention's config head counts (Phi-3's
                        ``qkv_proj``, grouped-query): whole heads and KV groups per rank
``"gate_up"``           a fused [gate; up] layer (Phi-3's ``gate_up_proj``): matching halves of gate and up
``"attention"``         an attention module with q_proj/k_proj/v_proj/o_proj and ``head_dim`` ->
                        ParallelSelfAttention (causal; the built-in GPT's, also under sequence parallelism)
``"gelu_mlp"``          an MLP with two linear layers around a GeLU -> ParallelMLP with the fused GeLU matmul
``"vocab"``             VocabParallelEmbedding (a plain ``nn.Embedding`` only)
``"scaled_vocab"``      the same times ``embed_scale`` (Gemma's scaled word embedding)
``"vocab_head"``        LM head split by vocabulary (sharing the embedding's shard when tied) + the
                        vocabulary-parallel cross-entropy
``"replicate"``         left as it is (excludes a module a broader pattern matched)
======================  ============================================================================

Built-in plans: the built-in GPT (``pyparallel.models.gpt``), Hugging Face GPT-2, the LLaMA layout (LLaMA,
Mistral, Qwen2, Qwen3, OLMo, Granite, Cohere, Helium, SmolLM3, Ministral, Arcee, EXAONE 4: q/k/v/gate/up
column, o/down row; rotary embeddings act per head and need no change), Phi-3 (fused qkv and gate/up), GLM
(LLaMA's attention, fused gate/up), Starcoder2 (c_fc column, c_proj row) and Gemma 1/2/3 (the LLaMA layout
with a scaled embedding).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch.nn as nn

from pyparallel.source import config_reads
from pyparallel.tensor_parallel.styles import STYLES  # noqa: F401 (the names a plan takes)

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

PHI3_PLAN = {
    "*embed_tokens": "vocab",
    "*layers.*.self_attn.qkv_proj": "fused_qkv",  # [q; k; v] sized by the config's (grouped) head counts
    "*layers.*.self_attn.o_proj": "row",
    "*layers.*.mlp.gate_up_proj": "gate_up",  # [gate; up], chunk(2)-ed by Phi3MLP
    "*layers.*.mlp.down_proj": "row",
    "lm_head": "vocab_head",
}

GEMMA_PLAN = {**LLAMA_PLAN, "*embed_tokens": "scaled_vocab"}  # x sqrt(hidden) in the embedding's forward

GLM_PLAN = {**{k: v for k, v in LLAMA_PLAN.items() if "gate_proj" not in k and "up_proj" not in k},
            "*layers.*.mlp.gate_up_proj": "gate_up"}  # LLaMA's attention, Phi-3's fused [gate; up]

STARCODER2_PLAN = {**{k: v for k, v in LLAMA_PLAN.items() if ".mlp." not in k},
                   "*layers.*.mlp.c_fc": "column", "*layers.*.mlp.c_proj": "row"}  # c_fc -> GeLU -> c_proj

# The LLaMA layout under other names of model_type; what sets each apart stays inside modules the plan does
# not split (Granite's multipliers, Cohere's logit scale, SmolLM3's layers without rotary), so each family's
# own forward runs unchanged around the split layers (tests/test_hf_tp.py checks every one against one
# process). Cohere with use_qk_norm (per-head LayerNorm weights) and OLMo 2/3 (q/k norms over all heads) are
# refused by check_attention: their norms would need splitting or a cross-rank statistic.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "olmo", "granite", "cohere", "helium", "smollm3",
                "ministral", "arcee", "exaone4")
HF_PLANS = {**{k: ("llama", LLAMA_PLAN) for k in LLAMA_FAMILY}, "phi3": ("phi3", PHI3_PLAN),
            "gemma": ("gemma", GEMMA_PLAN), "gemma2": ("gemma", GEMMA_PLAN), "gemma3_text": ("gemma", GEMMA_PLAN),
            "glm": ("glm", GLM_PLAN), "starcoder2": ("starcoder2", STARCODER2_PLAN)}


@dataclass
class ModelPlan:
    """A plan plus what parallelize needs to know about the model family."""

    family: str  # "gpt" (built-in), "gpt2", "llama", "phi3", "gemma" or "custom"
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
            "ffn width (ffn_mult * n_embd)": c.ffn_mult * c.n_embd})
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
            "n_inner (MLP width)": inner})
    if kind in HF_PLANS:
        family, styles = HF_PLANS[kind]
        return ModelPlan(family, dict(styles), sizes={
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads or cfg.num_attention_heads,
            "intermediate_size": cfg.intermediate_size})
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
# num_heads / embed_dim; LlamaAttention (and Mistral's, Qwen2/3's, Gemma's) views with -1 heads and keeps
# head_dim and num_key_value_groups (= heads / kv heads, unchanged by an even split), so it needs nothing;
# Phi3Attention slices its fused qkv by self.config.num_attention_heads and self.num_key_value_heads.

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "split_size",
               "embed_dim", "all_head_size")
# Config entries whose value changes when the heads are split (what an attention forward must not read
# from the model-wide config).
_HEAD_CONFIG = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "hidden_size", "n_embd",
                "embed_dim")


def _fix_gpt2_attention(module: nn.Module, t: int, name: str) -> None:
    if getattr(module, "is_cross_attention", False):
        raise ValueError(f"{name}: cross-attention GPT2Attention is not supported by the tensor-parallel plan")
    module.num_heads //= t
    module.embed_dim //= t
    module.split_size //= t


def local_head_config(module: nn.Module, t: int, name: str) -> None:
    """Give ``module`` its own copy of the config with the local head counts (the model's config, shared by
    every layer and saved with exports, keeps the global ones), and divide its own head-count attributes."""
    cfg = copy.copy(module.config)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        if isinstance(getattr(cfg, attr, None), int):
            setattr(cfg, attr, getattr(cfg, attr) // t)
    module.config = cfg
    for attr in ("num_heads", "num_key_value_heads"):
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, getattr(module, attr) // t)


def _sum_head_norm_grads(module: nn.Module, t: int, name: str) -> None:
    """Qwen3Attention (Gemma 3's, EXAONE 4's): q_norm / k_norm (RMSNorm over head_dim, replicated) are applied
    to this rank's heads only, so each rank's gradient of their weight is a partial sum over heads:
    all-reduce it over TP. A norm over more than one head (OLMo 2's, over all of them) is refused: its
    statistic would span ranks."""
    from pyparallel.tensor_parallel.layers import ColumnParallelLinear
    from pyparallel.tensor_parallel.mappings import register_allreduce_grad_hook

    group = next(m.group for m in module.modules() if isinstance(m, ColumnParallelLinear))
    for norm in ("q_norm", "k_norm"):
        for pname, p in getattr(module, norm).named_parameters():
            if p.shape != (module.head_dim,):
                raise ValueError(f"{name}.{norm}.{pname} has shape {tuple(p.shape)}, not (head_dim,) = "
                                 f"({module.head_dim},): the norm spans heads, which a split by heads cannot "
                                 f"compute on one rank; replicate {name}")
            register_allreduce_grad_hook(p, group)  # frozen ones too: they may be unfrozen later


ATTENTION_FIXES = {
    "GPT2Attention": _fix_gpt2_attention,
    "LlamaAttention": None,
    "MistralAttention": None,
    "Qwen2Attention": None,
    "Qwen3Attention": _sum_head_norm_grads,
    "Gemma3Attention": _sum_head_norm_grads,
    "Exaone4Attention": _sum_head_norm_grads,
    "GemmaAttention": None,
    "Gemma2Attention": None,
    "Phi3Attention": local_head_config,
    "CausalSelfAttention": None,  # pyparallel.models.gpt: heads derived from the layer widths
}


def check_attention(module: nn.Module, name: str, t: int, fixes: dict, split: tuple[str, ...] = ()) -> None:
    """Refuse a module that holds column-split projections and head-count attributes, or reads head counts
    from its config, or holds parameters of its own besides the ``split`` children (they may see only this
    rank's heads, as Qwen3's q_norm does, and get a partial gradient), when no fix for its class is known."""
    cls = type(module).__name__
    if t == 1 or cls in fixes:
        return
    own = [n for n, _ in module.named_parameters() if not any(n.startswith(c + ".") for c in split)]
    if own:
        raise ValueError(f"{name or 'the model'} ({cls}) holds column-split projections and parameters the plan "
                         f"leaves whole ({own}); they may act on this rank's heads only, so their gradients "
                         f"would be partial: pass attention_fixes={{'{cls}': fn(module, tp, name)}} that handles "
                         f"them (e.g. all-reduces their gradients), split them, or replicate the whole module")
    found = [a for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)]
    found += [f"config.{a}" for a in config_reads(type(module)) if a in _HEAD_CONFIG]
    if found:
        raise ValueError(f"{name or 'the model'} ({cls}) holds column-split projections and head-count "
                         f"attributes {found} (held or read) that pyparallel does not know how to adjust for "
                         f"tp={t}; pass attention_fixes={{'{cls}': fn(module, tp, name)}} to parallelize (for config "
                         f"reads: pyparallel.tensor_parallel.plans.local_head_config), or a plan that leaves this "
                         f"module replicated")


def verify_fixed(module: nn.Module, name: str, t: int, model_config) -> None:
    """After a fix: an attention forward that reads head counts from ``self.config`` must see the local ones
    (a fix that adjusted its attributes but left the shared config would crash or mis-slice)."""
    cfg = getattr(module, "config", None)
    if t == 1 or cfg is None or model_config is None:
        return
    for attr in config_reads(type(module)):
        if attr not in _HEAD_CONFIG or not isinstance(getattr(model_config, attr, None), int):
            continue
        want = getattr(model_config, attr) // t
        if attr in ("hidden_size", "n_embd", "embed_dim") or getattr(cfg, attr) != want:
            raise ValueError(f"{name} ({type(module).__name__}).forward reads self.config.{attr} = "
                             f"{getattr(cfg, attr)}, but this rank holds {want} after the split; the attention fix "
                             f"must give the module a config with the local value (see plans.local_head_config)")
