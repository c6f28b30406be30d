"""Hugging Face's label convention through the pipeline and ``parallelize``: unshifted ``labels=`` (-100
ignored) and a padding ``attention_mask=`` give HF's own ``model(input_ids, attention_mask, labels).loss``
on the whole batch in one process, and the same gradients and parameters; the data helpers
(``pyparallel.shard_batch``, ``pyparallel.data.microbatches``, ``pyparallel.dp_mean``).

The batch is padded (rows of different lengths; right padding, one row left-padded) with -100 labels at
the pads, and one row with a single real token, so some micro-batches hold fewer target tokens than others
and, at one row per micro-batch, one holds none. A mean of per-micro-batch means would be off; the
global-token mean is what HF computes.

Precision: one fp32 step against HF's unmodified loss (it casts logits to fp32, as our default loss does),
at fp32 tolerance; then float64 runs of several AdamW steps against HF's model whose loss function keeps
float64 (HF's shift and -100 rule, without its fp32 cast; tests/test_hf_tp.py explains why float64 for
Adam), compared at float64 tolerance: losses every step, parameters after.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist import run
from models import HF_FAMILIES, HF_MORE, TINY, hf_model

import pyparallel
from pyparallel.data import microbatches
from pyparallel.models.gpt import GPT, gpt_config
from pyparallel.pipeline_parallel import PipelineParallel

pytest.importorskip("transformers")

B, S, VOCAB, STEPS = 4, 10, 64, 3
LR, WD = 1e-2, 0.1
LENGTHS = (10, 6, 1, 8)  # real tokens per row; row 2 has nothing to predict
LEFT_PADDED = 3  # this row's padding is on the left


def padded_batch(seed):
    """input_ids, attention_mask, labels [B, S] (pads: id 0, mask 0, label -100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, S), generator=gen)
    mask = torch.zeros(B, S, dtype=torch.long)
    for r, n in enumerate(LENGTHS):
        if r == LEFT_PADDED:
            mask[r, S - n:] = 1
        else:
            mask[r, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def ce64(outputs, targets):
    """Token cross-entropy in the outputs' dtype (the pipeline's default upcasts to fp32, not fp64)."""
    return F.cross_entropy(outputs.flatten(0, -2), targets.flatten(), ignore_index=-100)


def hf_loss64(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
    """transformers' ForCausalLMLoss without its fp32 cast: labels padded with -100 and shifted left by one,
    mean over the tokens that are not -100 (or their sum over ``num_items_in_batch``)."""
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    if num_items_in_batch is None:
        return F.cross_entropy(logits.reshape(-1, vocab_size), shift.reshape(-1), ignore_index=-100)
    total = F.cross_entropy(logits.reshape(-1, vocab_size), shift.reshape(-1), ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


def make(kind, dtype):
    return hf_model(kind, seed=0).to(dtype)


def hf_reference(kind, steps=STEPS):
    """One process, whole batch, HF's own forward with labels and mask: losses and final parameters."""
    model = make(kind, torch.float64)
    model.loss_function = hf_loss64
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for s in range(steps):
        ids, mask, labels = padded_batch(100 + s)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def compare_params(full, ref_params, kind):
    """Every parameter equals the reference's; anything else in ``full`` is one of the model's buffers
    (Gemma's non-persistent ``embed_scale`` travels with the checkpoint) at its own value."""
    assert set(ref_params) <= set(full), sorted(set(ref_params) - set(full))
    buffers = dict(make(kind, torch.float64).named_buffers())
    for name, p in full.items():
        want = ref_params[name] if name in ref_params else buffers.get(name)
        assert want is not None, f"{name} is neither a parameter nor a buffer of the model"
        torch.testing.assert_close(p, want, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------- the blocks, in one process


@pytest.mark.parametrize("kind", [*HF_FAMILIES, "mistral-sliding", *HF_MORE])
def test_blocks_equal_hf_forward_with_padding(kind):
    """The pipeline's blocks, run in sequence, give the model's own logits on a padded batch: each layer
    gets the mask the model gives it (Gemma 2 alternates sliding-window and full layers; a Mistral with a
    window shorter than the sequence slides in every layer) and Gemma 2's logits are soft-capped; what
    the other families do around their layers (tests/models.py: HF_MORE) is reproduced: Granite's
    embedding multiplier and logits scaling, Cohere's logit scale, Gemma 3's and OLMo 3's rotary table
    per layer type."""
    from pyparallel.pipeline_parallel.adapters import hf_blocks

    model = hf_model("mistral", sliding_window=4) if kind == "mistral-sliding" else hf_model(kind)
    model = model.double()
    ids, mask, _ = padded_batch(5)
    ref = model(input_ids=ids, attention_mask=mask).logits
    x = ids
    for block in hf_blocks(model):
        x = block(x, attention_mask=mask) if getattr(block, "takes_attention_mask", False) else block(x)
    # HF's own eager Gemma 2 turns rows with a query that sees only padding (row 2's last positions fall out of
    # the window of its one token; row 3 is left-padded) into NaN in float64; the blocks give the same NaNs.
    assert ref[:2].isfinite().all()
    torch.testing.assert_close(x, ref, equal_nan=kind == "gemma2")


def test_embedding_dropout_draws_as_the_model_does():
    """Starcoder2 drops out its embeddings in its base model's forward (not in a module): the first block
    does the same, in the model's training mode, drawing the same mask from the same generator state."""
    from pyparallel.pipeline_parallel.adapters import hf_blocks

    model = hf_model("starcoder2", embedding_dropout=0.5).double()
    ids, mask, _ = padded_batch(5)
    for training in (True, False):
        model.train(training)
        torch.manual_seed(11)
        ref = model(input_ids=ids, attention_mask=mask).logits
        torch.manual_seed(11)
        x = ids
        for block in hf_blocks(model):
            x = block(x, attention_mask=mask) if getattr(block, "takes_attention_mask", False) else block(x)
        torch.testing.assert_close(x, ref)
    model.train()
    torch.manual_seed(11)
    assert not torch.equal(model(input_ids=ids).logits, ref)  # the dropout is really drawn in training


@pytest.mark.parametrize("stray", [{"final_logit_softcapping": 0.5}, {"sliding_window": 2},
                                   {"sliding_window": 2, "layer_types": ["sliding_attention"] * 2}])
def test_a_config_key_the_forward_does_not_read_changes_nothing(stray):
    """Keys a LLaMA config may carry but its forward never reads: a ``final_logit_softcapping`` (the head
    does not cap the logits either) or a ``sliding_window``, with or without ``layer_types`` (every layer
    still gets the full causal mask, as in LLaMA's own forward)."""
    from pyparallel.pipeline_parallel.adapters import hf_blocks

    model = hf_model("llama", **stray).double()
    ids, mask, _ = padded_batch(5)
    ref = model(input_ids=ids, attention_mask=mask).logits
    x = ids
    for block in hf_blocks(model):
        x = block(x, attention_mask=mask) if getattr(block, "takes_attention_mask", False) else block(x)
    torch.testing.assert_close(x, ref)


def test_a_forward_that_does_something_else_to_the_hidden_states_is_refused():
    """What reading the forwards by name cannot see, the dataflow check does (the forward and the blocks run
    on a meta copy, the steps between the input ids and the logits compared): transformers' own NanoChat
    applies its final norm before the layers as well; a user's base model adds the embeddings to every
    layer's input, or halves every layer's output; a causal LM adds a bias held by its base model after
    calling the parent's forward; a forward hook on the model doubles its logits. Each reads only names the
    blocks stand for, and each is a ValueError naming the first step where the forward and the blocks part.
    A forward the trace cannot run on meta (it reads a value) is refused, not passed unchecked."""
    import transformers
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel

    from pyparallel.pipeline_parallel.adapters import hf_blocks

    cfg = transformers.AutoConfig.for_model("nanochat", vocab_size=64, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"NanoChatForCausalLM: .*step 2 of its forward is `h2 = model.norm\(h1\)` "
                                         r"where the pipeline's blocks do `h2 = model.layers.0\(h1\)`"):
        hf_blocks(transformers.AutoModelForCausalLM.from_config(cfg))

    class EmbeddingsIntoEveryLayer(LlamaModel):
        def forward(self, input_ids=None, **kwargs):
            inputs_embeds = self.embed_tokens(input_ids)
            hidden_states = inputs_embeds
            for decoder_layer in self.layers:
                hidden_states = decoder_layer(hidden_states + inputs_embeds)
            return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))

    class HalvedLayers(LlamaModel):
        def forward(self, input_ids=None, **kwargs):
            hidden_states = self.embed_tokens(input_ids)
            for decoder_layer in self.layers:
                hidden_states = decoder_layer(hidden_states) * 0.5
            return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))

    class BiasedLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + self.model.logit_bias
            return out

    model = hf_model("llama")
    for base, step in [(EmbeddingsIntoEveryLayer, r"`h2 = add\(h1, h1\)` where the pipeline's blocks do "
                                                  r"`h2 = model.layers.0\(h1\)`"),
                       (HalvedLayers, r"`h3 = mul\(h2, 0.5\)` where the pipeline's blocks do "
                                      r"`h3 = model.layers.1\(h2\)`")]:
        model.model = base(model.config)
        with pytest.raises(ValueError, match=f"LlamaForCausalLM: .*step \\d of its forward is {step}"):
            hf_blocks(model)
    biased = BiasedLogits(model.config)
    biased.model.logit_bias = nn.Parameter(torch.zeros(model.config.vocab_size))
    with pytest.raises(ValueError, match=r"BiasedLogits: .*its forward is `h6 = add\(h5, tensor\[64\]:float32\)` "
                                         r"where the pipeline's blocks do `logits = h5`"):
        hf_blocks(biased)
    hooked = hf_model("llama")  # a forward hook on the model: the pipeline never calls the model itself
    hooked.register_forward_hook(lambda module, args, out: setattr(out, "logits", out.logits * 2.0))
    with pytest.raises(ValueError, match=r"its forward is `h6 = mul\(h5, 2.0\)` where the pipeline's blocks do "
                                         r"`logits = h5`"):
        hf_blocks(hooked)

    class CheckedLogits(LlamaForCausalLM):  # reads a value: the trace on meta cannot, so nothing is verified
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if not out.logits.isfinite().all():
                raise FloatingPointError("non-finite logits")
            return out

    model = CheckedLogits(model.config)
    with pytest.raises(ValueError, match=r"CheckedLogits: its forward could not run on the meta device "
                                         r"\(RuntimeError: .*meta"):
        hf_blocks(model)


def test_forward_reads_the_blocks_do_not_reproduce_are_refused():
    """What a causal LM's or its base model's forward does around the layers, the blocks must do too: a read
    of ``self`` they do not know, an input to the layers they do not rebuild, a switch they do not implement
    turned on, or a forward that runs fewer layers than the model holds is a ValueError naming it, never a
    pipeline of another model."""
    from transformers.models.llama.modeling_llama import LlamaModel

    from pyparallel.pipeline_parallel.adapters import hf_blocks

    class ScaledLlamaModel(LlamaModel):  # a user's variant: embeddings scaled in the base model's forward
        def forward(self, input_ids=None, **kwargs):
            return super().forward(inputs_embeds=self.embed_tokens(input_ids) * self.input_scale, **kwargs)

    class ValueResidualLlamaModel(LlamaModel):  # each layer also gets the embeddings
        def forward(self, input_ids=None, **kwargs):
            h = first = self.embed_tokens(input_ids)
            for layer in self.layers:
                h = layer(h, first_hidden=first, **kwargs)
            return self.norm(h)

    class ShiftedPositionsLlamaModel(LlamaModel):  # the layers' positions computed in the call
        def forward(self, input_ids=None, **kwargs):
            h = self.embed_tokens(input_ids)
            position_ids = torch.arange(h.shape[1]).unsqueeze(0)
            for layer in self.layers:
                h = layer(h, position_ids=position_ids + 1,
                          position_embeddings=self.rotary_emb(h, position_ids=position_ids + 1))
            return self.norm(h)

    model = hf_model("llama")
    model.model = ShiftedPositionsLlamaModel(model.config)
    with pytest.raises(ValueError, match=r"ShiftedPositionsLlamaModel.forward gives its layers "
                                         r"position_embeddings=self.rotary_emb.*, position_ids=position_ids \+ 1"):
        hf_blocks(model)
    scaled = ScaledLlamaModel(model.config)
    scaled.input_scale = 2.0
    model.model = scaled
    with pytest.raises(ValueError, match=r"ScaledLlamaModel.forward reads self.input_scale"):
        hf_blocks(model)
    model.model = ValueResidualLlamaModel(model.config)
    with pytest.raises(ValueError, match=r"ValueResidualLlamaModel.forward gives its layers first_hidden="):
        hf_blocks(model)

    with pytest.raises(ValueError, match=r"use_bidirectional_attention.*\(on: config.use_bidirectional_attention"):
        hf_blocks(hf_model("gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(ValueError, match=r"MixtralForCausalLM.forward reads .*self.router_aux_loss_coef.*"
                                         r"\(on: config.output_router_logits\)"):
        hf_blocks(hf_model("mixtral", output_router_logits=True))  # its auxiliary loss joins the loss

    model = hf_model("llama", layers=3)
    model.config.num_hidden_layers = 2  # the forward runs layers[:2]
    with pytest.raises(ValueError, match="holds 3 decoder layers but its forward runs config.num_hidden_layers = 2"):
        hf_blocks(model)


def test_older_transformers_is_refused(monkeypatch):
    """Before 5.24 transformers' mask builders call the cache ``past_key_values``: the blocks would fail
    inside the first layer; they refuse up front, naming the version."""
    from pyparallel.pipeline_parallel import adapters
    from pyparallel.pipeline_parallel.adapters import hf_blocks

    model = hf_model("llama")
    monkeypatch.setattr(adapters, "_transformers_version", lambda: "5.23.0")
    with pytest.raises(ValueError, match=r"needs transformers >= 5.24, found 5.23.0"):
        hf_blocks(model)


def test_unknown_layer_type_refused():
    from pyparallel.pipeline_parallel.adapters import hf_blocks

    model = hf_model("qwen3")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        hf_blocks(model)


# ------------------------------------------------------------------------- PipelineParallel, pp = 2


def pipeline_body(kind):
    mesh = pyparallel.init(pp=2)
    ids, mask, labels = padded_batch(7)

    # fp32, the default loss: one step's loss and every gradient against HF's unmodified loss.
    model = make(kind, torch.float32)
    serial = copy.deepcopy(model)
    ref = serial(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    # One row per micro-batch; checkpointed blocks recompute with the mask in backward.
    pipe = PipelineParallel(model, mesh, schedule="1f1b", num_microbatches=4, activation_checkpointing=True)
    loss = pipe.step(ids, labels=labels, attention_mask=mask)
    torch.testing.assert_close(torch.tensor(loss, dtype=torch.float32), ref.detach())
    held = []
    ref_grads = dict(serial.named_parameters())
    for name, p in model.named_parameters():  # the chunks hold the model's own parameters
        if p.grad is not None:
            held.append(name)
            torch.testing.assert_close(p.grad, ref_grads[name].grad, msg=lambda m, name=name: f"grad {name}: {m}")

    # The mask matters: without it the same labels give another loss (so it really reached the layers). The
    # step is deterministic, so any difference past fp32 rounding (~5e-7 here) is the mask's; Granite's
    # logits / 8 keep it near 1e-5, the others' above 1e-4.
    pipe.zero_grad()
    unmasked = pipe.step(ids, labels=labels)
    assert abs(unmasked - loss) > (5e-6 if kind == "granite" else 1e-4), (unmasked, loss)

    # float64, 3 AdamW steps, two micro-batches of two rows, zero-bubble schedule (split backward).
    ref_losses, ref_params = hf_reference(kind)
    model = make(kind, torch.float64)
    pipe = PipelineParallel(model, mesh, schedule="zb-h1", num_microbatches=2, loss_fn=ce64)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=LR, weight_decay=WD)
    losses = []
    for s in range(STEPS):
        ids, mask, labels = padded_batch(100 + s)
        losses.append(pipe.step(ids, labels=labels, attention_mask=mask))
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64))
    compare_params(pipe.full_state_dict(), ref_params, kind)

    # Aligned targets still work, and give the same as the labels they come from.
    ids, mask, labels = padded_batch(7)
    aligned = F.pad(labels[:, 1:], (0, 1), value=-100)
    a = pipe.step(ids, aligned, attention_mask=mask)
    pipe.zero_grad()
    b = pipe.step(ids, labels=labels, attention_mask=mask)
    pipe.zero_grad()
    assert a == b

    # Refusals: both conventions at once, a mask of the wrong shape, labels of the wrong shape, a mask for a
    # model whose blocks cannot take one, labels for a model without a language-model loss.
    errors = []
    for call in (lambda: pipe.step(ids, aligned, labels=labels),
                 lambda: pipe.step(ids, labels=labels, attention_mask=mask[:, :5]),
                 lambda: pipe.step(ids, labels=labels[:, :5]),
                 lambda: pipe.step(ids)):
        with pytest.raises(ValueError) as info:
            call()
        errors.append(str(info.value))
    seq = PipelineParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), mesh, num_microbatches=2,
                           loss_fn=lambda y, t: F.mse_loss(y, t))
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="attention_mask= needs a Hugging Face causal LM"):
        seq.step(x, x, attention_mask=torch.ones(4, 4))
    with pytest.raises(ValueError, match="labels= .* needs the built-in GPT or a Hugging Face"):
        seq.step(x, labels=torch.zeros(4, 4, dtype=torch.long))
    # The built-in GPT takes labels= too (it is a causal LM): the same as the targets they shift to.
    gpt = PipelineParallel(GPT(gpt_config("tiny", **TINY), seed=0), mesh, num_microbatches=2)
    a = gpt.step(ids, aligned)
    gpt.zero_grad()
    assert gpt.step(ids, labels=labels) == a
    return held, errors


# Granite, Cohere, Gemma 3: the blocks' multipliers, logit scale and rotary tables per layer type at pp = 2.
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2", "gemma", "granite", "cohere", "gemma3_text"])
def test_pipeline_pp2_hf_labels_and_mask(kind):
    results = run(pipeline_body, 2, kind)
    held = [set(h) for h, _ in results]
    names = {n for n, _ in make(kind, torch.float32).named_parameters()}
    assert held[0] | held[1] == names and held[0] != names  # each stage checked its own part, all covered
    errors = results[0][1]
    assert "not both" in errors[0]
    assert "attention_mask must be [batch, seq]" in errors[1] and "(4, 5)" in errors[1]
    assert "labels of shape (4, 5)" in errors[2] and "(4, 10)" in errors[2]
    assert "needs targets" in errors[3]


# ------------------------------------------------------------------------------- pyparallel.parallelize


def parallelize_body(kind, layouts):
    ref_losses, ref_params = hf_reference(kind)
    ids, mask, labels = padded_batch(100)
    # HF's own loss in one process, fp64: the reference's first loss (a sanity check of the reference).
    first = make(kind, torch.float64)
    first.loss_function = hf_loss64
    assert first(input_ids=ids, attention_mask=mask, labels=labels).loss.item() == ref_losses[0]
    for dp, tp, pp, zero, m in layouts:
        mesh = pyparallel.init(dp=dp, tp=tp, pp=pp)
        pm = pyparallel.parallelize(make(kind, torch.float64), mesh, zero_stage=zero, num_microbatches=m, lr=LR,
                                    weight_decay=WD, loss_fn=None if tp > 1 else ce64)
        losses = []
        for s in range(STEPS):
            batch = dict(zip(("input_ids", "attention_mask", "labels"), padded_batch(100 + s)))
            mine = pyparallel.shard_batch(batch, mesh)  # this replica's rows
            losses.append(pm.step(mine["input_ids"], labels=mine["labels"], attention_mask=mine["attention_mask"]))
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64),
                                   msg=lambda msg, lay=(dp, tp, pp): f"dp, tp, pp = {lay}: {msg}")
        compare_params(pm.full_state_dict(), ref_params, kind)
    return True


# Beyond LLaMA and GPT-2: Qwen2 (q/k/v biases), Gemma (scaled, tied embedding), Phi-3 (fused qkv and gate/up
# projections).
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2", "gemma", "phi3"])
def test_parallelize_pp2_hf_labels_and_mask(kind):
    run(parallelize_body, 2, kind, [(1, 1, 2, 0, 4)])


# Granite and Gemma 3 (built-in TP plans since they pipeline): scaled logits split by vocabulary, per-head q/k
# norms and per-layer-type rotary tables inside TP stages.
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2", "gemma", "granite", "gemma3_text"])
def test_parallelize_tp2pp2_and_dp2pp2_hf_labels_and_mask(kind):
    # dp2 x pp2: the replicas hold 14 and 8 target tokens (each replica's loss weighted by the global count);
    # ZeRO-1 on the DP axis.
    run(parallelize_body, 4, kind, [(1, 2, 2, 0, 2), (2, 1, 2, 1, 2)])


# ------------------------------------------------------------------------------------------ data helpers


def data_body():
    mesh = pyparallel.init(dp=2)
    ids, mask, labels = padded_batch(3)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    mine = pyparallel.shard_batch(batch, mesh)
    rows = slice(2 * mesh.dp_rank, 2 * mesh.dp_rank + 2)
    assert mine.keys() == batch.keys() and all(torch.equal(mine[k], batch[k][rows]) for k in batch)
    pair = pyparallel.shard_batch((ids, labels), mesh)
    assert isinstance(pair, tuple) and torch.equal(pair[0], ids[rows]) and torch.equal(pair[1], labels[rows])
    assert torch.equal(pyparallel.shard_batch(ids, mesh), ids[rows])
    errors = []
    for bad in (torch.zeros(5, 3), {"a": torch.zeros(4, 3), "b": torch.zeros(3, 3)}, [torch.zeros(4), 3]):
        with pytest.raises(ValueError) as info:
            pyparallel.shard_batch(bad, mesh)
        errors.append(str(info.value))
    # dp_mean: a number, a tensor (dtype kept), the same on both ranks.
    value = 1.5 + 2.0 * mesh.dp_rank  # 1.5 and 3.5
    mean = pyparallel.dp_mean(value, mesh)
    t = pyparallel.dp_mean(torch.tensor(value, dtype=torch.float32), mesh)
    assert t.dtype == torch.float32 and t.shape == ()
    with pytest.raises(ValueError, match="one number"):
        pyparallel.dp_mean(torch.ones(2), mesh)

    # DataParallel (gradients averaged over DP) with HF's num_items_in_batch = global count / dp: the
    # averaged gradients and the dp_mean of the losses are HF's on the whole batch, though the replicas
    # hold 14 and 8 target tokens.
    count = pyparallel.data.global_token_count(mine["labels"], mesh)
    serial = make("llama", torch.float64)
    serial.loss_function = hf_loss64
    ref = serial(**batch).loss
    ref.backward()
    model = make("llama", torch.float64)
    model.loss_function = hf_loss64
    ddp = pyparallel.DataParallel(model, mesh)
    loss = ddp(**mine, num_items_in_batch=count / mesh.dp).loss
    loss.backward()
    torch.testing.assert_close(pyparallel.dp_mean(loss.detach(), mesh), ref.detach())
    ref_grads = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, msg=lambda m, name=name: f"grad {name}: {m}")
    return mean, float(t), errors, count


def test_shard_batch_token_count_and_dp_mean():
    results = run(data_body, 2)
    assert [r[0] for r in results] == [2.5, 2.5] and [r[1] for r in results] == [2.5, 2.5]
    errors = results[0][2]
    assert "5 samples" in errors[0] and "dp=2" in errors[0]
    assert "batch['a']: 4" in errors[1] and "batch['b']: 3" in errors[1]
    assert "batch[1] is a int" in errors[2]
    # Rows score 9, 5, 0 and 8 tokens: the left-padded row's first real token is predicted from a pad (as in HF).
    assert [r[3] for r in results] == [22, 22]


def test_microbatches():
    ids, mask, labels = padded_batch(3)
    parts = microbatches({"input_ids": ids, "labels": labels}, 2)
    assert len(parts) == 2 and torch.equal(parts[1]["labels"], labels[2:])
    assert [p.shape[0] for p in microbatches(ids, 4)] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"batch of 4 samples is not divisible by num_microbatches \(3\)"):
        microbatches(ids, 3)
    with pytest.raises(ValueError, match="positive integer"):
        microbatches(ids, 0)
