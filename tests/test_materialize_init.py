"""The values a meta model gets without weights (``pyparallel.materialize``), in one process: the built-in
GPT's own GPT-2 initialisation, equal bit for bit to ``GPT(cfg, seed)`` built whole, whether the whole model is
initialised or one module at a time (``InitReader``, what a sharded rank reads its slices from); a Hugging Face
model's ``from_config`` scheme (``reset_parameters()``, then ``_init_weights``: N(0, initializer_range), not
torch's Kaiming bounds); ``seeded_default``, the same scheme under another seed."""

import math

import pytest
import torch
from models import hf_config

from pyparallel import materialize
from pyparallel.models.gpt import GPT, gpt_config

CPU = torch.device("cpu")


def meta_gpt(cfg, seed):
    with torch.device("meta"):
        return GPT(cfg, seed)


@pytest.mark.parametrize("seed", [0, 5])
def test_a_meta_gpt_materialised_equals_the_gpt_built_whole(seed):
    cfg = gpt_config("tiny", n_layer=3)
    whole = GPT(cfg, seed)
    meta = meta_gpt(cfg, seed)
    assert meta.embed.wte.weight.is_meta  # built on meta, nothing filled yet
    materialize.initialize(meta, CPU)
    assert meta.head.lm_head.weight is meta.embed.wte.weight  # still tied
    got, want = meta.state_dict(), whole.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # One module at a time, as each rank of a sharded wrapper reads it: the same tensors.
    reader = materialize.open_source(meta_gpt(cfg, seed), CPU)
    for name, p in whole.named_parameters():
        assert torch.equal(reader.full(reader.prefix + name), p.detach()), name


def test_the_gpt_init_is_gpt2s_and_differs_by_seed_and_module():
    cfg = gpt_config("small-test")
    model = GPT(cfg, 0)
    block = model.blocks[0]
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    torch.testing.assert_close(block.attn.q_proj.weight.std().item(), 0.02, rtol=0.05, atol=0)
    torch.testing.assert_close(block.mlp.fc_out.weight.std().item(), resid, rtol=0.05, atol=0)
    torch.testing.assert_close(block.attn.o_proj.weight.std().item(), resid, rtol=0.05, atol=0)
    assert torch.count_nonzero(block.mlp.fc_in.bias) == 0 and bool((block.ln_1.weight == 1).all())
    assert not torch.equal(model.blocks[0].attn.q_proj.weight, model.blocks[1].attn.q_proj.weight)
    assert not torch.equal(model.blocks[0].attn.q_proj.weight, GPT(cfg, 1).blocks[0].attn.q_proj.weight)


def test_a_meta_hf_model_gets_from_configs_initialisation():
    transformers = pytest.importorskip("transformers")
    cfg = hf_config("llama", hidden=64, heads=4, kv_heads=2, vocab=96)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    materialize.initialize(model, CPU)
    std = cfg.initializer_range
    layer = model.model.layers[0]
    # Kaiming's uniform bound for fan-in 64 would give a std of 1/sqrt(3 * 64) = 0.072.
    torch.testing.assert_close(layer.self_attn.q_proj.weight.std().item(), std, rtol=0.05, atol=0)
    torch.testing.assert_close(model.model.embed_tokens.weight.std().item(), std, rtol=0.05, atol=0)
    assert bool((layer.input_layernorm.weight == 1).all())
    ref = transformers.AutoModelForCausalLM.from_config(cfg)  # the same scheme, drawn in another order
    torch.testing.assert_close(ref.model.layers[0].self_attn.q_proj.weight.std().item(), std, rtol=0.05, atol=0)

    def built(init):
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(cfg)
        materialize.initialize(m, CPU, init)
        return m.model.layers[0].mlp.up_proj.weight

    other = built(materialize.seeded_default(model, 3))
    assert torch.equal(other, built(materialize.seeded_default(model, 3)))  # deterministic
    assert not torch.equal(other, layer.mlp.up_proj.weight)  # another seed, other values
    torch.testing.assert_close(other.std().item(), std, rtol=0.05, atol=0)  # the same scheme
