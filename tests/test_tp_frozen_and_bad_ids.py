"""Tensor parallelism keeps frozen parameters frozen, and refuses token ids outside the vocabulary.

* Every parameter the split builds trains exactly when the one it was cut from does (LLaMA, Qwen2's q/k/v
  biases, Qwen3's head norms, GPT-2's Conv1D weights and biases, the built-in GPT under sequence
  parallelism, a model split on the meta device), and training with frozen layers at tp=2 equals one
  process (float64): losses, clip norms, every parameter, the frozen ones untouched.
* One process raises IndexError for an input id or a label outside the vocabulary. Split by vocabulary, no
  rank owns such an id: it was summed as a zero embedding, or scored against a logit of 0 (loss inf, or a
  wrong finite loss for -1). Now each case is a ValueError naming the value, its position and the
  vocabulary, on every rank and before any collective. Ids at the edges of the vocabulary still give one
  process's loss.
"""

import copy
import types

import pytest
import torch
import torch.nn as nn
from dist import run
from models import TINY, batches, hf_model

import pyparallel
from pyparallel.data.tokens import check_token_ids
from pyparallel.models.gpt import GPT, gpt_config
from pyparallel.tensor_parallel import full_parameters, parallelize, vocab_parallel_cross_entropy
from pyparallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

pytest.importorskip("transformers")

# Layer 0 frozen whole; in layer 1 single tensors, so a layer's weight and bias disagree (a column bias, a
# row weight, GPT-2's fused-GeLU bias) and the flags cannot be right by copying one per layer.
FROZEN = {
    "llama": ("layers.0.", "layers.1.mlp.down_proj.weight", "layers.1.self_attn.o_proj.weight"),
    "qwen2": ("layers.0.", "layers.1.self_attn.q_proj.bias", "layers.1.self_attn.v_proj.bias"),
    "qwen3": ("layers.0.", "layers.1.self_attn.q_norm.weight"),  # a replicated norm with a TP grad hook
    "gpt2": ("h.0.", "h.1.mlp.c_fc.bias", "h.1.attn.c_proj.weight", "h.1.mlp.c_proj.bias"),
}


def _freeze(model, patterns):
    for name, p in model.named_parameters():
        if any(f in name for f in patterns):
            p.requires_grad_(False)
    return {name: p.requires_grad for name, p in model.named_parameters()}


def _fake_mesh(t, rank):
    """A TP group of t ranks without a process group: the split and the meta-device init need none."""
    group = types.SimpleNamespace(size=t, rank=rank, name="tp", ranks=tuple(range(t)))
    return types.SimpleNamespace(tp=t, tp_rank=rank, tp_group=group, device=torch.device("cpu"))


def _assert_flags_kept(model, want):
    got = {name: p.requires_grad for name, p in model.named_parameters()}
    assert got.keys() == want.keys()
    assert [n for n in got if got[n] != want[n]] == []
    assert any(want.values()) and not all(want.values())  # both kinds present
    split = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert any(not p.requires_grad for m in split for p in m.parameters())  # frozen TP shards exist


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
@pytest.mark.parametrize("kind", sorted(FROZEN))
def test_split_keeps_requires_grad(kind, meta):
    for rank in (0, 1):
        if meta:
            with torch.device("meta"):
                model = hf_model(kind)
        else:
            model = hf_model(kind)
        want = _freeze(model, FROZEN[kind])
        parallelize(model, _fake_mesh(2, rank))  # meta: shards materialized by the model's init
        _assert_flags_kept(model, want)
        assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_sequence_parallel_split_keeps_requires_grad():
    """The built-in GPT under sequence parallelism: a frozen LayerNorm gets no gradient hook (registering
    one raised RuntimeError), a frozen row-parallel bias stays frozen."""
    model = GPT(gpt_config("tiny", **TINY), seed=0)
    want = _freeze(model, ("blocks.0.", "blocks.1.mlp.fc_out.bias", "blocks.1.ln_1"))
    parallelize(model, _fake_mesh(2, 1), sequence_parallel=True)
    _assert_flags_kept(model, want)


# -------------------------------------------------------------------- training with frozen layers, tp=2

B, S, STEPS, CLIP = 4, 10, 3, 0.5
SPECS = {
    # tied embeddings, vocabulary 67 padded to 68: o_proj / down_proj (row) and q/k/v biases (column) frozen
    "qwen2": dict(vocab=67, tie_word_embeddings=True),
    # Conv1D weights, the fused qkv, the GeLU MLP (c_fc's frozen bias enters the fused kernel)
    "gpt2": dict(vocab=64),
}


def _hf_ids(vocab, step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (B, S), generator=gen)


def _double_loss(logits, labels, vocab_size, **kwargs):
    shift = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift.reshape(-1))


def _frozen_model(kind):
    model = hf_model(kind, **SPECS[kind]).double()
    _freeze(model, FROZEN[kind])
    return model


def _reference(kind):
    model = _frozen_model(kind)
    model.loss_function = _double_loss
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for s in range(STEPS):
        idx = _hf_ids(SPECS[kind]["vocab"], s)
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def frozen_train_body(kind):
    mesh = pyparallel.init(tp=2)
    model = _frozen_model(kind)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    pm = pyparallel.parallelize(model, mesh, lr=1e-2, weight_decay=0.1, clip_grad_norm=CLIP)
    losses, norms = [], []
    for s in range(STEPS):
        idx = _hf_ids(SPECS[kind]["vocab"], s)
        losses.append(pm.forward_backward(idx, labels=idx))
        pm.optimizer.step()
        pm.optimizer.zero_grad()
        norms.append(pm.last_grad_norm)
    return losses, norms, pm.full_state_dict(), start


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_frozen_layers_train_as_one_process_at_tp2(kind):
    ref_losses, ref_norms, ref = _reference(kind)
    losses, norms, full, start = run(frozen_train_body, 2, kind)[0]
    f64 = dict(dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(losses, **f64), torch.tensor(ref_losses, **f64))
    torch.testing.assert_close(torch.tensor(norms, **f64), torch.tensor(ref_norms, **f64))
    assert full.keys() == ref.keys()
    for name, p in full.items():
        torch.testing.assert_close(p.double(), ref[name], msg=lambda m, name=name: f"{name}: {m}")
    assert len(start) > 4
    for name, p in start.items():  # bit for bit: never updated, never decayed
        assert torch.equal(full[name].double(), p), name


def _train(m, data, forward, **adamw):
    """AdamW over ``m``'s trainable parameters, one step per batch; the losses."""
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, **adamw)
    losses = []
    for idx, tgt in data:
        loss = forward(m, idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_as_one_process(model, serial, out):
    """Losses ``out = [serial's, model's]`` and every gathered parameter equal; the gathered parameters."""
    torch.testing.assert_close(torch.tensor(out[1], dtype=torch.float64), torch.tensor(out[0], dtype=torch.float64))
    full, ref = full_parameters(model), dict(serial.named_parameters())
    for name, p in full.items():
        torch.testing.assert_close(p, ref[name].detach(), msg=lambda m, name=name: f"{name}: {m}")
    return full


def sp_frozen_body():
    """tensor_parallel.parallelize with sequence parallelism, frozen block 0, plain torch AdamW."""
    mesh = pyparallel.init(tp=2)
    model = GPT(gpt_config("tiny", **TINY), seed=0).double()
    _freeze(model, ("blocks.0.", "blocks.1.ln_1"))
    serial = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    parallelize(model, mesh, sequence_parallel=True)
    out = [_train(m, batches(STEPS, B, 12), lambda m, idx, tgt: m(idx, tgt), weight_decay=0.1)
           for m in (serial, model)]
    full = _assert_as_one_process(model, serial, out)
    assert all(torch.equal(full[n], p) for n, p in start.items())
    return len(start)


def test_frozen_block_sequence_parallel_trains_as_one_process():
    assert run(sp_frozen_body, 2)[0] > 4


def unfreeze_body(kind):
    """Gradual unfreezing after the split (tensor_parallel.parallelize): replicated parameters whose
    gradient is a partial sum per rank -- sequence-parallel LayerNorms, Qwen3's q_norm / k_norm -- were
    frozen when split, then trained. Their sums over the TP group must be there once they train."""
    mesh = pyparallel.init(tp=2)
    if kind == "gpt-sp":
        model, frozen = GPT(gpt_config("tiny", **TINY), seed=0).double(), ("ln_1", "ln_2", "ln_f")
    else:
        model, frozen = hf_model("qwen3").double(), ("q_norm", "k_norm")
        model.loss_function = _double_loss
    _freeze(model, frozen)
    serial = copy.deepcopy(model)
    parallelize(model, mesh, sequence_parallel=kind == "gpt-sp")
    def forward(m, idx, tgt):
        return m(idx, tgt) if kind == "gpt-sp" else m(input_ids=idx, labels=idx).loss

    out = []
    for m in (serial, model):
        losses = _train(m, batches(4, B, 12)[:2], forward)  # frozen
        for p in m.parameters():
            p.requires_grad_(True)
        out.append(losses + _train(m, batches(4, B, 12)[2:], forward))  # then everything trains
    full = _assert_as_one_process(model, serial, out)
    return sum(any(f in name for f in frozen) for name in full)


@pytest.mark.parametrize("kind", ["gpt-sp", "qwen3"])
def test_parameters_unfrozen_after_the_split_train_as_one_process(kind):
    assert run(unfreeze_body, 2, kind)[0] >= 4


# --------------------------------------------------------------------------- ids outside the vocabulary

V = 67  # padded to 68 at tp=2: id 67 is a padding row, and no rank owns 70


def test_check_token_ids_names_value_position_and_vocabulary():
    ids = torch.tensor([[1, 2, 3], [4, 70, 66]])
    with pytest.raises(ValueError, match=r"input id 70 at position \(1, 1\) is outside the vocabulary of 67 "
                                         r"tokens; it must be a token id in \[0, 67\)"):
        check_token_ids(ids, V, "input id")
    labels = torch.tensor([[-100, 5, -1, -100]])
    with pytest.raises(ValueError, match=r"label -1 at position \(0, 3\) .* ignore_index \(-100\) or a token id"):
        check_token_ids(labels, V, "label", ignore_index=-100, shift=1)
    check_token_ids(torch.tensor([[0, 66, -100]]), V, "label", ignore_index=-100)  # the edges, and ignored
    check_token_ids(torch.empty(0, 3, dtype=torch.long), V, "input id")
    with pytest.raises(ValueError, match="-100 at position"):  # -100 is no input id
        check_token_ids(torch.tensor([-100]), V, "input id")


def _message(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "accepted"


def _serial_refuses(fn):
    with pytest.raises(IndexError):
        fn()
    return True


def bad_ids_body():
    mesh = pyparallel.init(tp=2)
    model = hf_model("llama", vocab=V, tie_word_embeddings=False).double()
    serial = copy.deepcopy(model)
    serial.loss_function = _double_loss
    parallelize(model, mesh)
    ids = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(0))

    def bad(t, value, pos=(0, 3)):
        t = t.clone()
        t[pos] = value
        return t

    out = {}
    for value in (70, 67, -1):  # the layers themselves: the embedding, then the loss on split logits
        out[f"id {value}"] = _message(lambda v=value: model(input_ids=bad(ids, v)))
        _serial_refuses(lambda v=value: serial(input_ids=bad(ids, v)))
        out[f"label {value}"] = _message(lambda v=value: model(input_ids=ids, labels=bad(ids, v)))
        _serial_refuses(lambda v=value: serial(input_ids=ids, labels=bad(ids, v)))
    # labels[:, 0] is never a target (one process ignores it too); the edges and -100 are one process's loss
    edge_ids, edge_labels = bad(bad(ids, 0, (1, 2)), V - 1, (0, 5)), bad(bad(ids, -100, (0, 1)), V - 1, (1, 4))
    edge_labels[:, 0] = 99
    torch.testing.assert_close(model(input_ids=edge_ids, labels=edge_labels).loss,
                               serial(input_ids=edge_ids, labels=edge_labels).loss)
    logits = torch.randn(16, 34, dtype=torch.float64)  # this rank's half of 68 columns
    target = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(1))
    out["ce padded column"] = _message(lambda: vocab_parallel_cross_entropy(logits, bad(target, 67, 5), mesh.tp_group,
                                                                            vocab_size=V))
    out["ce no padding"] = _message(lambda: vocab_parallel_cross_entropy(logits, bad(target, 68, 5), mesh.tp_group))

    # pyparallel.parallelize: the batch is checked on its way in, before the first collective
    pm = pyparallel.parallelize(hf_model("llama", vocab=V, tie_word_embeddings=False).double(), mesh, lr=1e-2)
    for value in (70, 67):
        out[f"step id {value}"] = _message(lambda v=value: pm.forward_backward(bad(ids, v), labels=ids))
    for value in (70, 67, -1):
        out[f"step label {value}"] = _message(lambda v=value: pm.forward_backward(ids, labels=bad(ids, v)))
    out["step target 67"] = _message(lambda: pm.forward_backward(ids, bad(ids, 67)))
    out["step ok"] = _message(lambda: pm.forward_backward(ids, labels=bad(ids, -100)))
    return out


def test_ids_outside_the_vocabulary_are_refused_at_tp2():
    rank0, rank1 = run(bad_ids_body, 2)
    assert rank0 == rank1  # every rank refuses, with the same words
    for value in (70, 67, -1):
        assert rank0[f"id {value}"].startswith(f"model.embed_tokens: input id {value} at position (0, 3) is "
                                               "outside the vocabulary of 67 tokens")  # the layer names itself
        assert rank0[f"label {value}"].startswith(f"label {value} at position (0, 3) is outside the vocabulary "
                                                  "of 67 tokens; it must be ignore_index (-100) or a token id in "
                                                  "[0, 67)")
        assert rank0[f"step label {value}"].startswith(f"label {value} at position (0, 3) ")
    for value in (70, 67):
        assert rank0[f"step id {value}"].startswith(f"input id {value} at position (0, 3) ")
    assert rank0["step target 67"].startswith("target 67 at position (0, 3) ")
    assert rank0["ce padded column"].startswith("vocab_parallel_cross_entropy: target 67 at position (5,) ")
    assert "of 68 tokens" in rank0["ce no padding"]  # without vocab_size every column is a token
    assert rank0["step ok"] == "accepted"


def pipeline_bad_label_body():
    mesh = pyparallel.init(tp=2, pp=2)
    pm = pyparallel.parallelize(hf_model("llama", vocab=V, tie_word_embeddings=False).double(), mesh, lr=1e-2,
                                num_microbatches=2)
    ids = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 6] = 67
    return _message(lambda: pm.forward_backward(ids, labels=labels))


def test_tp_and_pp_refuse_on_every_stage():
    """With pp=2 the embedding's and the loss's own checks run on one stage each: the other stage would wait
    for it in a send or receive. The batch check raises on all four ranks instead."""
    got = run(pipeline_bad_label_body, 4, deadline_s=120)
    assert len(set(got)) == 1 and got[0].startswith("label 67 at position (1, 6) ")


def flat_head_body():
    """parallelize's vocabulary-parallel loss takes logits in the targets' layout, or flattened to
    [tokens, V/t] (a head with its own layout), as one process's cross-entropy does; shapes that do not
    hold the same number of tokens are still refused."""
    from pyparallel.parallel import _vocab_loss

    mesh = pyparallel.init(tp=2)
    loss = _vocab_loss(mesh.tp_group, V)
    full = torch.randn(2, 5, 68, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    full[..., V:] = float("-inf")  # the padding column scores nothing
    mine = full[..., 34 * mesh.tp_rank:34 * (mesh.tp_rank + 1)]
    target = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(4))
    shaped, flat = loss(mine, target), loss(mine.reshape(10, 34), target)
    ref = nn.functional.cross_entropy(full[..., :V].reshape(10, V), target.reshape(-1))
    return float(shaped), float(flat), float(ref), _message(lambda: loss(mine.reshape(5, 2, 34)[:4], target))


def test_vocab_loss_takes_flat_logits_as_one_process():
    for shaped, flat, ref, bad in run(flat_head_body, 2):
        assert shaped == pytest.approx(ref, rel=1e-12) and flat == pytest.approx(ref, rel=1e-12)
        assert "disagree on the leading (token) dimensions" in bad
