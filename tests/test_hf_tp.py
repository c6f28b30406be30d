"""Tensor parallelism on real transformers model classes (tiny random-init configs, no download): every
built-in plan equals one process at tp=2 and tp=4, plans matched by names but not by behaviour are refused,
and an odd vocabulary (GPT-2's 50257) is padded, equals one process and saves unpadded.

Parity, as tests/test_tensor_parallel.py: the gathered logits, the loss and every gradient of one step at
fp32 tolerance; losses and parameters after 3 AdamW steps in float64 (in fp32 Adam's first step,
g / (|g| + eps), turns last-bit differences of another summation order into lr-sized ones for entries
whose first gradient is tiny; float64 leaves nothing that amplifies past the tolerance)."""

import copy
import types

import pytest
import torch
import torch.nn as nn
from dist import run
from models import HF_FAMILIES, hf_config, hf_model

import pyparallel
from pyparallel.tensor_parallel import full_parameters, parallelize
from pyparallel.tensor_parallel.plans import GEMMA_PLAN, LLAMA_PLAN, PHI3_PLAN

pytest.importorskip("transformers")

B, S, STEPS = 2, 10, 3


def _ids(vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=gen)


def _double_loss(logits, labels, vocab_size, **kwargs):
    """transformers' causal-LM loss without its fp32 cast, so a float64 run stays float64 end to end."""
    shift = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift.reshape(-1))


def _steps(model, vocab):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for s in range(STEPS):
        idx = _ids(vocab, 100 + s)
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def parity_body(kind, config, vocab_multiple=64):
    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    vocab = config.get("vocab", 64)
    model = hf_model(kind, **config)
    serial = copy.deepcopy(model)
    parallelize(model, mesh, vocab_multiple=vocab_multiple)
    idx = _ids(vocab, 7)
    torch.testing.assert_close(model(input_ids=idx).logits, serial(input_ids=idx).logits)  # gathered, unpadded
    loss, ref = model(input_ids=idx, labels=idx).loss, serial(input_ids=idx, labels=idx).loss
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    grads, ref_grads = full_parameters(model, grad=True), {n: p.grad for n, p in serial.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=lambda m, name=name: f"grad of {name}: {m}")

    model = hf_model(kind, **config).double()
    serial = copy.deepcopy(model)
    serial.loss_function = _double_loss
    ref_losses = _steps(serial, vocab)
    parallelize(model, mesh, vocab_multiple=vocab_multiple)
    losses = _steps(model, vocab)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64))
    full, ref = full_parameters(model), dict(serial.named_parameters())
    assert full.keys() == ref.keys()
    for name, p in full.items():
        torch.testing.assert_close(p, ref[name].detach(), msg=lambda m, name=name: f"{name}: {m}")
    return [type(m).__name__ for m in model.modules() if "Parallel" in type(m).__name__]


@pytest.mark.parametrize("kind", HF_FAMILIES)
def test_builtin_plan_t2(kind):
    kinds = run(parity_body, 2, kind, {})[0]
    assert "VocabParallelEmbedding" in kinds and "RowParallelLinear" in kinds


# The families of tests/models.py's HF_MORE with a built-in plan: Granite's multipliers, Cohere's logit scale and
# tied embedding, Gemma 3's and EXAONE 4's per-head q/k norms, Starcoder2's biased GeLU MLP, GLM's fused
# gate/up, SmolLM3's layers without rotary, sliding layers.
TP_MORE = ("granite", "cohere", "gemma3_text", "olmo", "starcoder2", "exaone4", "smollm3", "glm", "helium",
           "ministral", "arcee")


@pytest.mark.parametrize("kind", TP_MORE)
def test_builtin_plan_t2_more_families(kind):
    kinds = run(parity_body, 2, kind, {})[0]
    assert "VocabParallelEmbedding" in kinds and "RowParallelLinear" in kinds and "ColumnParallelLinear" in kinds


def test_norms_across_heads_are_refused():
    """OLMo 2's q/k norms span all heads (RMSNorm over heads x head_dim), and Cohere's with use_qk_norm hold a
    weight per head: a split by heads cannot compute them on one rank, so they are refused, with the LLaMA
    plan too; the fix that sums Qwen 3's per-head norms' gradients refuses a norm that spans heads."""
    from pyparallel.tensor_parallel.plans import _sum_head_norm_grads

    for kind, extra in (("olmo2", {}), ("olmo3", {}), ("cohere", dict(use_qk_norm=True))):
        model = hf_model(kind, **extra)
        before = _unchanged(model)
        with pytest.raises(ValueError, match="no built-in tensor-parallel plan" if kind != "cohere" else
                           r"CohereAttention\) holds column-split projections and parameters the plan leaves "
                           r"whole \(\['q_norm.weight', 'k_norm.weight'\]\)"):
            parallelize(model, _fake_mesh(2))
        with pytest.raises(ValueError, match=r"leaves whole \(\['q_norm.weight', 'k_norm.weight'\]\)"):
            parallelize(model, _fake_mesh(2), LLAMA_PLAN)
        assert _unchanged(model) == before
    with pytest.raises(ValueError, match=r"q_norm.weight has shape \(32,\), not \(head_dim,\) = \(8,\): the norm "
                                         r"spans heads"):
        parallelize(hf_model("olmo2"), _fake_mesh(2), LLAMA_PLAN,
                    attention_fixes={"Olmo2Attention": _sum_head_norm_grads})


@pytest.mark.parametrize("kind", HF_FAMILIES)
def test_builtin_plan_t4(kind):
    run(parity_body, 4, kind, dict(heads=8, kv_heads=4))  # 2 query heads and 1 KV head per rank


def test_phi3_split_keeps_head_groups_and_local_config():
    """Phi-3 at tp=2, 4 query / 2 KV heads: each rank holds its 2 query heads and their 1 KV head in
    qkv_proj, matching gate/up halves, and its attention reads a config of its own with the local head
    counts while the model's config (saved with exports) keeps the global ones."""
    model = hf_model("phi3")
    full_qkv = model.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    full_gu = model.model.layers[0].mlp.gate_up_proj.weight.detach().clone()
    mesh = _fake_mesh(2, rank=1)
    parallelize(model, mesh)
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    q, k, v = full_qkv.split([4 * d, 2 * d, 2 * d])
    torch.testing.assert_close(attn.qkv_proj.weight, torch.cat([q[2 * d:], k[d:], v[d:]]), rtol=0, atol=0)
    gate, up = full_gu.chunk(2)
    half = gate.shape[0] // 2
    torch.testing.assert_close(model.model.layers[0].mlp.gate_up_proj.weight, torch.cat([gate[half:], up[half:]]),
                               rtol=0, atol=0)
    assert (attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.num_key_value_heads) == (2, 1, 1)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)


def own_loss_body():
    """A causal LM whose forward computes its loss itself, not through ``self.loss_function``: with labels its
    head still gathers the logits, so the loss is the one process's (split logits would be scored as if the
    vocabulary were this rank's slice)."""
    import transformers

    class OwnLossLlama(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
            loss = None if labels is None else nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
            return types.SimpleNamespace(loss=loss, logits=logits)

    mesh = pyparallel.init(tp=2)
    torch.manual_seed(0)
    model = OwnLossLlama(hf_config("llama"))
    serial = copy.deepcopy(model)
    parallelize(model, mesh)
    idx = _ids(64, 3)
    out, ref = model(input_ids=idx, labels=idx), serial(input_ids=idx, labels=idx)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    out.loss.backward()
    ref.loss.backward()
    grads = full_parameters(model, grad=True)
    for name, p in serial.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
    return True


def test_forward_with_its_own_loss_gets_whole_logits():
    run(own_loss_body, 2)


# ------------------------------------------------------------------------------------------ refusals


def _fake_mesh(t, rank=0):
    """A mesh whose TP group has t ranks but no process group: checks must fail before any collective
    (and a build that needs none can run)."""
    group = types.SimpleNamespace(size=t, rank=rank, name="tp", ranks=tuple(range(t)))
    return types.SimpleNamespace(tp=t, tp_group=group)


def _unchanged(model):
    return [type(m) for m in model.modules()]


@pytest.mark.parametrize("kind", ["gemma", "gemma2"])
def test_llama_plan_on_gemma_is_refused(kind):
    model = hf_model(kind)
    before = _unchanged(model)
    with pytest.raises(ValueError, match=r"model.embed_tokens: Gemma2?TextScaledWordEmbedding overrides "
                                         r"nn.Embedding.forward.*use style 'scaled_vocab'"):
        parallelize(model, _fake_mesh(2), LLAMA_PLAN)
    assert _unchanged(model) == before


def test_column_on_phi3_fused_layers_is_refused():
    model = hf_model("phi3")
    before = _unchanged(model)
    plan = {**PHI3_PLAN, "*layers.*.mlp.gate_up_proj": "column"}
    with pytest.raises(ValueError, match=r"layers.0.mlp.gate_up_proj: Phi3MLP.forward cuts this layer's output "
                                         r"\(.chunk\(...\)\).*use 'gate_up'"):
        parallelize(model, _fake_mesh(2), plan)
    plan = {**PHI3_PLAN, "*layers.*.self_attn.qkv_proj": "column"}
    with pytest.raises(ValueError, match=r"qkv_proj: Phi3Attention.forward cuts .*slicing.*'fused_qkv'"):
        parallelize(model, _fake_mesh(2), plan)
    plan = {**PHI3_PLAN, "*layers.*.self_attn.qkv_proj": "qkv"}  # equal thirds: wrong with 4 q / 2 kv heads
    with pytest.raises(ValueError, match=r"4 query and 2 key/value heads.*use style 'fused_qkv'"):
        parallelize(model, _fake_mesh(2), plan)
    with pytest.raises(ValueError, match=r"o_proj: style 'row' needs its input split"):
        parallelize(model, _fake_mesh(2), LLAMA_PLAN)  # names half-match: o_proj without q/k/v
    assert _unchanged(model) == before


def test_attention_reading_config_head_counts_is_refused():
    """An attention class pyparallel does not know that reads head counts from its config is refused, and
    a user fix that adjusts its attributes but not what its forward reads is caught after the fix."""
    model = hf_model("phi3")
    cls = type(model.model.layers[0].self_attn)
    Unknown = type("MyAttention", (cls,), {})  # same forward, unknown name
    for layer in model.model.layers:
        layer.self_attn.__class__ = Unknown
    with pytest.raises(ValueError, match=r"MyAttention\) holds column-split projections and head-count attributes "
                                         r"\['num_key_value_heads', 'config.num_attention_heads'\]"):
        parallelize(model, _fake_mesh(2))

    def attributes_only(module, t, name):
        module.num_key_value_heads //= t

    with pytest.raises(ValueError, match=r"reads self.config.num_attention_heads = 4, but this rank holds 2"):
        parallelize(model, _fake_mesh(2), attention_fixes={"MyAttention": attributes_only})


def test_embedding_subclass_and_scaled_check():
    class Shifted(nn.Embedding):
        def forward(self, idx):
            return super().forward(idx) + 1

    class FakeScaled(nn.Embedding):  # has an embed_scale but does something else
        embed_scale = torch.tensor(2.0)

        def forward(self, idx):
            return super().forward(idx) * 3

    for cls, style, match in [(Shifted, "vocab", "Shifted overrides nn.Embedding.forward.*'replicate'"),
                              (FakeScaled, "scaled_vocab", "not the lookup times embed_scale")]:
        model = nn.ModuleDict({"emb": cls(16, 4)})
        with pytest.raises(ValueError, match=match):
            parallelize(model, _fake_mesh(2), {"emb": style})


def test_builtin_plans_per_family():
    from pyparallel.tensor_parallel.plans import detect

    for kind in (*HF_FAMILIES, *TP_MORE):
        plan = detect(hf_model(kind))
        expected = {"gpt2": "gpt2", "phi3": "phi3", "gemma": "gemma", "gemma2": "gemma", "gemma3_text": "gemma",
                    "glm": "glm", "starcoder2": "starcoder2"}.get(kind, "llama")
        assert plan.family == expected, kind
    assert detect(hf_model("gemma")).styles == GEMMA_PLAN


# ------------------------------------------------------------------------------------ vocabulary padding


def test_padded_sizes():
    from pyparallel.tensor_parallel.layers import padded_vocab_size

    assert padded_vocab_size(50257, 2, 64) == 50304  # Megatron's GPT-2 figure (multiple of 128)
    assert padded_vocab_size(50257, 4, 64) == 50432
    assert padded_vocab_size(50257, 2, 1) == 50258
    assert padded_vocab_size(32000, 4, 64) == 32000  # divisible already: unchanged
    with pytest.raises(ValueError, match="vocabulary size 65 padded to 256 .* rank 3 without a real row"):
        padded_vocab_size(65, 4, 64)
    model = hf_model("gpt2", vocab=50257, hidden=8, heads=2)
    with pytest.raises(ValueError, match="vocabulary size 50257 is not divisible .* padding is off"):
        parallelize(model, _fake_mesh(2), vocab_multiple=None)


@pytest.mark.parametrize("t", [2, 4])
def test_gpt2_50257_padded_parity(t):
    run(parity_body, t, "gpt2", dict(vocab=50257, hidden=8, heads=4, layers=1))


def padding_body(tmp):
    """The padded rows: zero, -inf logits (never the argmax), no gradient, still zero after steps; the
    checkpoint holds the original 50257 rows and loads into a plain one-process model."""
    from pyparallel import checkpoint

    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    cfg = dict(vocab=50257, hidden=8, heads=2, layers=1)
    model = hf_model("gpt2", **cfg)
    parallelize(model, mesh)
    head, emb = model.lm_head, model.transformer.wte
    assert head.weight is emb.weight and emb.padded_size == 50304 and head.out_features == 50304
    pad = head.weight.shape[0] - head.local_valid  # padded rows on this rank (all on the last)
    assert pad == (47 if mesh.tp_rank == 1 else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(2):
        idx = _ids(50257, s)
        out = model(input_ids=idx, labels=idx)
        if pad:
            assert torch.isneginf(out.logits[..., -pad:]).all()
        out.loss.backward()
        if pad:
            assert not head.weight.grad[-pad:].any()
        opt.step()
        opt.zero_grad()
    if pad:
        assert not head.weight[-pad:].any()
    assert model(input_ids=_ids(50257, 9)).logits.shape[-1] == 50257
    checkpoint.save(tmp, model, opt, step=2, mesh=mesh)
    full = {n: p.detach().clone() for n, p in full_parameters(model).items()}
    plain = hf_model("gpt2", seed=1, **cfg)
    checkpoint.load(tmp, plain)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p, full[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    # Back into a padded TP model with its optimizer: the next step equals the uninterrupted one.
    again = parallelize(hf_model("gpt2", seed=2, **cfg), mesh)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2, weight_decay=0.1)
    checkpoint.load(tmp, again, opt2)
    idx = _ids(50257, 5)
    for m, o in ((model, opt), (again, opt2)):
        m(input_ids=idx, labels=idx).loss.backward()
        o.step()
    for name, p in full_parameters(again).items():
        torch.testing.assert_close(p, full_parameters(model)[name], msg=lambda m, name=name: f"{name}: {m}")
    if pad:
        assert not again.lm_head.weight[-pad:].any()
    return tuple(plain.transformer.wte.weight.shape)


def test_padded_rows_never_win_and_never_reach_a_checkpoint(tmp_path):
    assert run(padding_body, 2, str(tmp_path / "ckpt"))[0] == (50257, 8)


def test_vocab_parallel_loss_ignores_padded_columns():
    """The loss masks the columns past vocab_size itself: Gemma 2's soft-capping turns the head's -inf
    into -cap, which would otherwise enter the softmax (one process, t=1 stand-in for the last rank)."""
    from pyparallel.tensor_parallel import vocab_parallel_cross_entropy

    group = types.SimpleNamespace(size=1, rank=0, name="tp", ranks=(0,))
    import pyparallel.comm as comm

    logits = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 7, (6,))
    orig = comm.all_reduce
    comm.all_reduce = lambda t, g, op="sum": t  # one rank: the reductions are identities
    try:
        loss = vocab_parallel_cross_entropy(logits, target, group, vocab_size=7)
    finally:
        comm.all_reduce = orig
    ref = nn.functional.cross_entropy(logits[:, :7], target)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert not logits.grad[:, 7:].any()


def test_config_builders_are_real_classes():
    for kind in HF_FAMILIES:
        assert hf_config(kind).model_type == kind
