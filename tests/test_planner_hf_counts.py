"""The planner counts what a Hugging Face model holds: ``pyparallel plan --model config.json`` builds the
config's own transformers class on the meta device and counts its embeddings, layers and the rest, so every
family's extras (per-head q/k norms, Gemma 2/3's four norms per layer, biases, Mixtral's experts, a tied
head) are in the count; without transformers the shape formula counts, and a config saved by transformers 5
(``rope_parameters``, no ``rope_theta``) is still rotary, not a model with learned positions."""

import json

import pytest
import torch
from models import HF_FAMILIES, HF_MORE, hf_config

from pyparallel.planner import specs
from pyparallel.planner.specs import load_hf_config

transformers = pytest.importorskip("transformers")


def _saved(cfg, tmp_path):
    cfg.save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


@pytest.mark.parametrize("kind", [*HF_FAMILIES, *HF_MORE])
def test_counts_equal_the_models_own(kind, tmp_path):
    cfg = hf_config(kind)
    with torch.device("meta"):
        model = (transformers.GPT2LMHeadModel(cfg) if kind == "gpt2"
                 else transformers.AutoModelForCausalLM.from_config(cfg))
    spec = load_hf_config(_saved(cfg, tmp_path))
    assert spec.counts is not None
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel() + (cfg.n_positions * cfg.n_embd if kind == "gpt2" else 0)
    assert spec.embedding_params() == embedding
    layers = model.transformer.h if kind == "gpt2" else model.model.layers
    assert spec.layer_params() == sum(p.numel() for p in layers[0].parameters())  # the layers are alike here


def test_shape_formula_without_transformers(tmp_path, monkeypatch):
    """The fallback: LLaMA's layout counted exactly from a transformers-5 config (rotary through
    rope_parameters: no position embeddings), a head size that is not hidden / heads included."""
    monkeypatch.setattr(specs, "count_with_transformers", lambda cfg: None)
    for extra in ({}, dict(head_dim=16)):  # 4 heads of 16 on a hidden size of 32
        cfg = hf_config("llama", **extra)
        path = _saved(cfg, tmp_path / str(len(extra)))
        raw = json.load(open(path))
        assert "rope_parameters" in raw and "rope_theta" not in raw
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        spec = load_hf_config(path)
        assert spec.counts is None and spec.positions == 0
        assert spec.num_params() == sum(p.numel() for p in model.parameters())
        assert spec.q_dim == cfg.num_attention_heads * cfg.head_dim


def test_uneven_layers_are_counted_per_stage(tmp_path):
    """DeepSeek-V3's first layer is dense and the rest are mixtures of experts: a pipeline stage holds its
    own layers' parameters (not the mean layer's times its count), and ZeRO-3's gathered unit is the
    largest layer."""
    from pyparallel.planner.search import stage_first_layer, stage_layers, stage_params, unit_params

    cfg = transformers.AutoConfig.for_model(
        "deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert per_layer[0] != per_layer[1] == per_layer[3]  # the dense layer is another size
    spec = load_hf_config(_saved(cfg, tmp_path))
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    for pp in (1, 2, 3, 4):
        for stage in range(pp):
            first = stage_first_layer(4, pp, stage)
            layers = sum(per_layer[first:first + stage_layers(4, pp, stage)])
            extra = (spec.embedding_params() if stage == 0 else 0) + (spec.head_params() if stage == pp - 1 else 0)
            assert stage_params(spec, pp, stage) == layers + extra
    assert unit_params(spec) == max(max(per_layer), spec.embedding_params())
