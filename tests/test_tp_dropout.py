"""Dropout under tensor parallelism equals one process drawing the same masks (tensor_parallel/random.py).

The TP run trains the built-in GPT with dropout 0.2 everywhere (embedding, attention probabilities, MLP
output) at t=2 (and t=4 with sequence parallelism). The one-process reference is the plain model, whose
replicated-activation dropouts draw from the default generator seeded the same way, and whose split-
activation dropouts are given the masks the TP ranks draw: per layer, rank r's mask from the stream seeded
``seed_of(r)``, concatenated over ranks by head (attention) or by sequence (the MLP output under sequence
parallelism). Losses and every parameter after 5 AdamW steps match at default float64 tolerance (see DTYPE). If the TP
ranks drew their head masks from one stream, or a replicated dropout from their own streams, the masks
would differ from the reference and the losses would not match.

Hugging Face GPT-2 (embedding, attention and residual dropout) and LLaMA (attention dropout) at t=2 are
checked the same way, through an attention function registered with transformers' AttentionInterface
(eager math in the model's dtype; the reference's is given the ranks' head masks); the replicated
dropouts draw from the default generator on both sides.
"""

import copy
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist import run
from models import TINY, batches

import pyparallel
from pyparallel.models.gpt import GPT, gpt_config
from pyparallel.tensor_parallel import full_parameters, parallelize
from pyparallel.tensor_parallel import random as tp_random

STEPS, B, S, P, SEED = 5, 4, 12, 0.2, 1234
# float64: in fp32 the losses match, but Adam turns the last-bit differences of the TP reduction order (and
# of SDPA's fused math against the reference's written-out one) into 1e-4 steps on the rarely-used embedding
# rows, whose tiny gradients it normalizes to full-size updates; float64 leaves only the masks to differ.
DTYPE = torch.float64


class RankStreams:
    """The TP ranks' model-parallel streams, replayed in one process."""

    def __init__(self, seeds):
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]

    def mask(self, shape, dim, dtype):
        """Each rank's keep-mask over its slice (``shape`` is one rank's), concatenated along ``dim``.
        bernoulli_(1 - p) on a tensor of the activations' dtype is what dropout draws on the CPU."""
        return torch.cat([torch.empty(shape, dtype=dtype).bernoulli_(1 - P, generator=g) for g in self.gens], dim)


def _reference_attention(self, x):
    """CausalSelfAttention.forward with SDPA's math written out and the TP ranks' head masks."""
    b, s, _ = x.shape
    q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, a, s, d]
    k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # [b, a, s, s]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    if self.training:
        a, t = q.shape[1], len(self._streams.gens)
        att = att * self._streams.mask((b, a // t, s, s), 1, att.dtype) / (1 - P)
    return self.o_proj((att @ v).transpose(1, 2).reshape(b, s, -1))


class SequenceSplitDropout(nn.Module):
    """The MLP output dropout under sequence parallelism: rank r drops its own slice of the sequence."""

    def __init__(self, streams):
        super().__init__()
        self.streams = streams

    def forward(self, y):
        if not self.training:
            return y
        b, s, h = y.shape
        return y * self.streams.mask((b, s // len(self.streams.gens), h), 1, y.dtype) / (1 - P)


def _train(model, mesh=None):
    if mesh is None:
        torch.manual_seed(SEED)
    else:
        tp_random.manual_seed(mesh, SEED)  # default generators: SEED; model-parallel: SEED + offset + tp_rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for idx, tgt in batches(STEPS, B, S):
        if mesh is None:  # the built-in GPT's own loss casts to fp32; the vocab-parallel one keeps float64
            loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
        else:
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def dropout_body(sp, overrides):
    t = torch.distributed.get_world_size()
    mesh = pyparallel.init(tp=t)
    model = GPT(gpt_config("tiny", **{**TINY, "dropout": P, **overrides}), seed=0).to(DTYPE)
    serial = copy.deepcopy(model)
    parallelize(model, mesh, sequence_parallel=sp)
    rng = tp_random.tracker(mesh)

    rng.manual_seed(SEED)  # only to read the seeds the TP ranks will use
    streams = RankStreams([rng.seed_of(r) for r in range(t)])
    for block in serial.blocks:
        block.attn._streams = streams
        block.attn.forward = types.MethodType(_reference_attention, block.attn)
        if sp:
            block.mlp.dropout = SequenceSplitDropout(streams)
    ref_losses = _train(serial)
    no_dropout = _train(copy.deepcopy(serial).eval())
    assert max(abs(a - b) for a, b in zip(ref_losses, no_dropout)) > 1e-2, (ref_losses, no_dropout)

    losses = _train(model, mesh)
    torch.testing.assert_close(torch.tensor(losses, dtype=DTYPE), torch.tensor(ref_losses, dtype=DTYPE))
    full, ref = full_parameters(model), dict(serial.named_parameters())
    for name, p in full.items():
        torch.testing.assert_close(p, ref[name].detach(), msg=lambda m, name=name: f"{name}: {m}")
    return rng.seed_of()


@pytest.mark.parametrize("sp", [False, True])
def test_builtin_gpt_dropout_t2(sp):
    seeds = run(dropout_body, 2, sp, {"n_kv_head": 2})  # grouped-query attention: 4 heads, 2 KV heads
    assert seeds[0] != seeds[1]  # each TP rank its own model-parallel stream


def test_builtin_gpt_dropout_t4_sequence_parallel():
    run(dropout_body, 4, True, {"n_head": 4, "n_kv_head": 4})


def test_fork_swaps_only_inside_and_keeps_its_stream():
    rng = tp_random.ModelParallelRNG(tp_rank=1, seed=7)
    torch.manual_seed(3)
    with rng.fork():
        a = torch.rand(4)
        with rng.fork():  # re-entrant: the same stream
            b = torch.rand(4)
        with rng.replicated():  # back to the default stream for replicated activations
            d0 = torch.rand(4)
    with rng.fork():
        c = torch.rand(4)
    d1 = torch.rand(4)
    g = torch.Generator().manual_seed(7 + tp_random.MODEL_PARALLEL_OFFSET + 1)
    assert torch.equal(torch.cat([a, b, c]), torch.rand(12, generator=g))
    g = torch.Generator().manual_seed(3)
    assert torch.equal(torch.cat([d0, d1]), torch.rand(8, generator=g))


def test_checkpoint_context_replays_the_model_parallel_stream():
    from torch.utils.checkpoint import checkpoint

    rng = tp_random.ModelParallelRNG(tp_rank=0, seed=11)
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        with rng.fork():
            return torch.nn.functional.dropout(x @ w, 0.5)

    x = torch.randn(4, 8)
    rng.manual_seed(11)
    fn(x).sum().backward()
    expected, w.grad = w.grad.clone(), None
    rng.manual_seed(11)
    checkpoint(fn, x, use_reentrant=False, context_fn=tp_random.checkpoint_context).sum().backward()
    torch.testing.assert_close(w.grad, expected)


# ------------------------------------------------------------------------------------- Hugging Face GPT-2
# Hugging Face attention keeps its own forward (only its linear layers are split), so parallelize runs it
# inside fork() and steps GPT-2's resid_dropout (replicated: after c_proj's all-reduce) back out. What is
# checked here: the replicated hidden states stay identical on every TP rank with all three GPT-2 dropouts
# on, the attention drew from each rank's own stream, and a dropout of unknown role is refused. Not
# checked: equality with one process (the reference would have to replay each rank's head masks inside
# transformers' attention functions); the built-in GPT above carries that parity.


def _gpt2(p, extra=False):
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=p,
                                  embd_pdrop=p, attn_pdrop=p, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    if extra:
        model.transformer.h[1].attn.extra_dropout = nn.Dropout(p)
    return model


def hf_gpt2_body():
    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    model = parallelize(_gpt2(P), mesh)
    tp_random.manual_seed(mesh, SEED)
    model.train()
    idx = batches(1, B, S)[0][0]
    hidden = model(input_ids=idx, output_hidden_states=True).hidden_states
    gathered = [None] * mesh.tp
    torch.distributed.all_gather_object(gathered, [h.detach() for h in hidden])
    for layer, (mine, other) in enumerate(zip(gathered[0], gathered[1])):
        assert torch.equal(mine, other), f"hidden state {layer} differs between TP ranks"
    states = tp_random.tracker(mesh)._states
    assert list(states) == [("cpu", None)], "the attention did not run inside fork()"
    fresh = torch.Generator().manual_seed(tp_random.tracker(mesh).seed_of()).get_state()
    assert not torch.equal(states[("cpu", None)], fresh), "the attention drew nothing from its stream"
    with pytest.raises(ValueError, match=r"h\.1\.attn\.extra_dropout: dropout \(p=0\.2\)"):
        parallelize(_gpt2(P, extra=True), mesh)
    return True


def test_hugging_face_gpt2_dropout_keeps_replicas_identical():
    pytest.importorskip("transformers")
    run(hf_gpt2_body, 2)


def checkpointed_pipeline_body():
    """tp2 x pp2 with dropout: activation checkpointing recomputes each block with the forward's masks
    (model-parallel stream replayed through checkpoint_context), so it trains exactly like no recompute."""
    mesh = pyparallel.init(tp=2, pp=2)
    results = []
    for recompute in (False, True):
        model = GPT(gpt_config("tiny", **{**TINY, "n_layer": 2, "dropout": P}), seed=0).to(DTYPE)
        pm = pyparallel.parallelize(model, mesh, num_microbatches=2, activation_checkpointing=recompute,
                                    optimizer=torch.optim.AdamW, lr=1e-2)
        tp_random.manual_seed(mesh, SEED)
        losses = [pm.step(idx, tgt) for idx, tgt in batches(3, B, S)]
        results.append((losses, {n: p.detach().clone() for n, p in pm.named_parameters()}))
    (plain, p_plain), (ckpt, p_ckpt) = results
    assert plain == ckpt, (plain, ckpt)
    for name, p in p_plain.items():
        torch.testing.assert_close(p_ckpt[name], p, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    return plain


def test_activation_checkpointing_replays_tp_dropout_in_a_pipeline():
    losses = run(checkpointed_pipeline_body, 4)
    assert len({tuple(x) for x in losses}) == 1  # every rank reports the pipeline's loss


# ------------------------------------------------ Hugging Face models: one process given the ranks' masks


def _hf_attention(streams):
    """An attention function for transformers' AttentionInterface: eager math in the model's dtype (HF's
    eager LLaMA softmaxes in fp32, which would round a float64 run), with dropout on the probabilities
    drawn by ``F.dropout`` (the TP ranks, inside their model-parallel stream) or, given ``streams``, the
    ranks' masks concatenated over heads (the one-process reference)."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, a, s, d = query.shape
        rep = a // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        scores = (query @ key.transpose(-1, -2)) * (scaling if scaling is not None else d ** -0.5)
        causal = torch.ones(s, key.shape[-2], dtype=torch.bool).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        if module.training and dropout > 0:
            if streams is None:
                att = F.dropout(att, dropout)
            else:
                att = att * streams.mask((b, a // len(streams.gens), s, key.shape[-2]), 1, att.dtype) / (1 - dropout)
        return (att @ value).transpose(1, 2).contiguous(), att

    return attend


def _hf(kind, p):
    import transformers
    from models import hf_config

    extra = (dict(resid_pdrop=p, embd_pdrop=p, attn_pdrop=p) if kind == "gpt2" else dict(attention_dropout=p))
    cfg = hf_config(kind, **extra)
    torch.manual_seed(0)
    return (transformers.GPT2LMHeadModel(cfg) if kind == "gpt2" else transformers.LlamaForCausalLM(cfg)).to(DTYPE)


def _hf_train(model, mesh=None):
    if mesh is None:
        torch.manual_seed(SEED)
    else:
        tp_random.manual_seed(mesh, SEED)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for idx, _ in batches(STEPS, B, S):
        logits = model(input_ids=idx).logits  # gathered under TP
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def hf_dropout_body(kind):
    import transformers

    t = torch.distributed.get_world_size()
    mesh = pyparallel.init(tp=t)
    transformers.AttentionInterface.register("tp_ranks", _hf_attention(None))
    model = _hf(kind, P)
    serial = copy.deepcopy(model)
    model.config._attn_implementation = "tp_ranks"
    parallelize(model, mesh)
    rng = tp_random.tracker(mesh)
    rng.manual_seed(SEED)  # only to read the seeds the TP ranks will use
    streams = RankStreams([rng.seed_of(r) for r in range(t)])
    transformers.AttentionInterface.register("tp_reference", _hf_attention(streams))
    serial.config._attn_implementation = "tp_reference"
    ref_losses = _hf_train(serial)
    no_dropout = _hf(kind, 0.0)
    no_dropout.config._attn_implementation = "tp_reference"
    assert max(abs(a - b) for a, b in zip(ref_losses, _hf_train(no_dropout))) > 1e-2

    losses = _hf_train(model, mesh)
    torch.testing.assert_close(torch.tensor(losses, dtype=DTYPE), torch.tensor(ref_losses, dtype=DTYPE))
    full, ref = full_parameters(model), dict(serial.named_parameters())
    assert full.keys() == ref.keys()
    for name, p in full.items():
        torch.testing.assert_close(p, ref[name].detach(), msg=lambda m, name=name: f"{name}: {m}")
    return True


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_dropout_t2_equals_one_process_with_the_ranks_masks(kind):
    """GPT-2 (embedding, attention and residual dropout) and LLaMA (attention dropout) at t=2."""
    pytest.importorskip("transformers")
    run(hf_dropout_body, 2, kind)
