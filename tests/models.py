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


# ------------------------------------------------------------------------------- Hugging Face models
# Small random-init configs of real transformers classes (no download): 2 layers, grouped-query attention
# where the family has it, and a vocabulary the caller picks (e.g. GPT-2's 50257 for vocabulary padding).

HF_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2")
# More decoder families, each with what sets it apart from LLaMA around or inside its layers: Granite's
# embedding, residual, attention and logit multipliers; Cohere's logit scale (and its tied embedding);
# Gemma 3's scaled embedding, per-head q/k norms, sliding layers with their own rotary table; OLMo 2/3's
# q/k norms over all heads (3: sliding layers, a rotary table per layer type); Starcoder2's biases and
# GeLU MLP; EXAONE 4's and SmolLM3's layer types (SmolLM3: layers without rotary); StableLM's partial
# rotary; GLM's fused gate/up; Mixtral's experts.
HF_MORE = ("granite", "cohere", "gemma3_text", "olmo", "olmo2", "olmo3", "starcoder2", "exaone4", "smollm3",
           "stablelm", "glm", "helium", "ministral", "seed_oss", "arcee", "mixtral")


def hf_config(kind: str, *, hidden: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 64, layers: int = 2,
              **overrides):
    """A tiny transformers config of family ``kind`` (one of :data:`HF_FAMILIES` or :data:`HF_MORE`)."""
    import transformers

    if kind == "gpt2":
        cfg = dict(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=vocab, n_positions=32, resid_pdrop=0.0,
                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
        return transformers.GPT2Config(**{**cfg, **overrides})
    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  head_dim=hidden // heads, attention_dropout=0.0)
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "phi3": "Phi3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "granite": "GraniteConfig",
               "cohere": "CohereConfig", "gemma3_text": "Gemma3TextConfig", "olmo": "OlmoConfig",
               "olmo2": "Olmo2Config", "olmo3": "Olmo3Config", "starcoder2": "Starcoder2Config",
               "exaone4": "Exaone4Config", "smollm3": "SmolLM3Config", "stablelm": "StableLmConfig",
               "glm": "GlmConfig", "helium": "HeliumConfig", "ministral": "MinistralConfig",
               "seed_oss": "SeedOssConfig", "arcee": "ArceeConfig", "mixtral": "MixtralConfig"}
    extra = {"phi3": dict(resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=32),
             "gemma2": dict(sliding_window=8, attn_implementation="eager"),
             "mistral": dict(sliding_window=None), "qwen2": dict(use_sliding_window=False),
             "qwen3": dict(use_sliding_window=False),
             "granite": dict(embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                             attention_multiplier=0.0625),
             "cohere": dict(logit_scale=0.125),
             "gemma3_text": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
             "olmo3": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
             "exaone4": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
             "smollm3": dict(no_rope_layer_interval=2), "stablelm": dict(partial_rotary_factor=0.5),
             "ministral": dict(sliding_window=4), "seed_oss": dict(residual_dropout=0.0),
             "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)}.get(kind, {})
    if kind == "phi3":
        common.pop("head_dim")
    return getattr(transformers, classes[kind])(**{**common, **extra, **overrides})


def hf_model(kind: str, seed: int = 0, **config):
    """A tiny random-init transformers causal LM of family ``kind``, the same on every rank for one seed."""
    import transformers

    cfg = hf_config(kind, **config)
    torch.manual_seed(seed)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(cfg)
    # Mixtral's experts as a loop of matmuls: its default grouped GEMM takes no float64.
    experts = {"experts_implementation": "eager"} if kind == "mixtral" else {}
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation
                                                         if kind == "gemma2" else "sdpa", **experts)


def train_built_on_meta(args) -> dict:
    """``pyparallel.train.train(args)``, asserting that it built the whole model only on the meta device."""
    from pyparallel import train as train_mod

    built, build = [], train_mod.build_model

    def spy(*a):
        model = build(*a)
        built.extend({p.device.type for p in model.parameters()})
        return model

    train_mod.build_model = spy
    try:
        out = train_mod.train(args)
    finally:
        train_mod.build_model = build
    assert set(built) == {"meta"}, built
    return out
