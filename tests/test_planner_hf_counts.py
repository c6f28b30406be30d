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
