"""Pipeline pieces that need no processes (schedules, message order, partition, Hugging Face blocks),
and Hugging Face parity on two stages."""

import types

import pytest
import torch
import torch.nn as nn
from dist import run
from models import TINY
from test_pipeline import compare, gpt_data, reference, tiny_gpt, train_pipe

import pyparallel
from pyparallel.models.gpt import GPT, gpt_config
from pyparallel.pipeline_parallel import PipelineParallel, schedules
from pyparallel.pipeline_parallel.partition import balance, plan_chunks, to_blocks, token_vocab

# -------------------------------------------------------------------------------- no processes needed


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_schedules_are_deadlock_free_and_meet_theory(schedule, v):
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            sim = schedules.simulate(schedule, p, m, v)  # raises on a deadlock
            assert sim["bubble"] == pytest.approx(schedules.theoretical_bubble(p, m, v))
            for r in range(p):
                limit = schedules.inflight_limit(schedule, r, p, m, v)
                assert sim["peak_inflight"][r] == limit
                assert limit <= {"gpipe": m, "1f1b": p}.get(schedule, limit)
                actions = schedules.build(schedule, r, p, m, v)
                assert sorted(actions) == sorted(
                    schedules.Action(k, c, i) for k in "FB" for c in range(r, p * v, p) for i in range(m))


def test_play_at_measured_times_counts_uneven_stages_and_message_latency():
    """``schedules.play`` (what ``stats()["bubble_simulated"]`` replays): at unit times it is ``simulate``;
    a slower stage and a message latency stretch the step exactly as the dependencies say."""
    for schedule, v in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2)):
        lists = [schedules.build(schedule, r, 4, 8, v) for r in range(4)]
        whole_b = 1.0 if schedule in schedules.SPLIT_BACKWARD else 2.0  # B + W in one without a split
        unit = schedules.play(lists, schedule, 4, lambda r, a, b=whole_b, v=v: (b if a.kind == "B" else 1.0) / v)
        assert unit == schedules.simulate(schedule, 4, 8, v)
    # GPipe, p = m = 2, unit times: F0.0 F0.1 | F1.0 (from 1.25) F1.1 B1.0 B1.1 (until 5.25) | B0.0 (from
    # 4.5) B0.1 (from 5.5, until 6.5): the first message and the last each add their latency
    gpipe = [schedules.build("gpipe", r, 2, 2) for r in range(2)]
    sim = schedules.play(gpipe, "gpipe", 2, lambda r, a: 1.0, latency=0.25)
    assert sim["step"] == pytest.approx(6.5) and sim["busy"] == [4.0, 4.0]
    # 1F1B, p = 2, m = 2, the last stage twice as slow: F0 F0 | F1 B1 F1 B1 | B0 B0 -> the last stage is
    # busy 8 from t = 1, the first stage waits for each gradient: step 1 + 8 + 1 = 10
    lists = [schedules.build("1f1b", r, 2, 2) for r in range(2)]
    sim = schedules.play(lists, "1f1b", 2, lambda r, a: 1.0 + r)
    assert sim["step"] == pytest.approx(10.0) and sim["busy"] == [4.0, 8.0]
    assert sim["bubble"] == pytest.approx((6.0 + 2.0) / 20.0)


def test_every_message_has_a_receiver_in_order():
    """What a sender sends to its neighbour is, message for message, what the neighbour consumes."""
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        p, m = 4, 8
        lists = [schedules.build(schedule, r, p, m, v) for r in range(p)]
        for src in range(p):
            for dst in range(p):
                if src == dst:
                    continue
                msgs = schedules.messages_from(lists[src], src, dst, p, p * v)
                data = sorted(k for k in msgs if k[0] != "meta")
                needed = sorted([("act", a.chunk - 1, a.mb) for a in lists[dst]
                                 if a.kind == "F" and a.chunk > 0 and (a.chunk - 1) % p == src]
                                + [("grad", a.chunk, a.mb) for a in lists[dst]
                                   if a.kind == "B" and a.chunk + 1 < p * v and (a.chunk + 1) % p == src])
                assert data == needed


def test_partition_balances_and_names_the_numbers():
    assert balance([10, 5, 5, 5, 5, 10], 2) == [0, 3, 6]
    assert balance([100, 1, 1, 1, 1, 1, 50], 3) == [0, 1, 6, 7]
    blocks, loss = to_blocks(GPT(gpt_config("tiny", **{**TINY, "n_layer": 3})))
    assert len(blocks) == 5 and loss is not None
    assert plan_chunks(blocks, 2, 1) in ([0, 3, 5], [0, 2, 5])
    with pytest.raises(ValueError, match="4 pipeline stages, but the model has only 3 blocks"):
        plan_chunks(blocks[:3], 4, 1)
    with pytest.raises(ValueError, match="num_microbatches \\(3\\) is smaller .* stages \\(4\\)"):
        schedules.check_config("1f1b", 4, 3, 1)


@pytest.mark.parametrize("backward", ["none", "retain_graph", "plain"])
def test_activation_meter_counts_and_lets_the_graph_go(backward):
    """The saved-tensor meter counts a storage once, not the parameters, and lets every saved tensor go with
    the graph, also one dropped without a backward or kept by ``retain_graph`` (a pack hook keeping a saved
    output with its grad_fn would leak the graph: exp saves its output)."""
    from pyparallel.pipeline_parallel import SavedTensorMeter

    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedTensorMeter(exclude=lin.parameters())
    with meter:
        h = lin(x)  # saves x (128 B) and the weight (excluded)
        y = torch.exp(h)  # saves its output (128 B)
        loss = (y * y).sum()  # saves y twice: counted once
    assert meter.live == meter.peak == 2 * 4 * 8 * 4
    if backward != "none":
        loss.backward(retain_graph=backward == "retain_graph")
    del h, y, loss
    assert meter.live == 0 and meter.peak == 256


def test_weight_pass_frees_the_micro_batch_without_the_garbage_collector(split_analysis):
    """After B and W of a split backward, nothing of the micro-batch's graph is left: its saved tensors go
    when W returns, not when the cyclic garbage collector next runs (a self-calling closure in the graph
    analysis once held every node: ZB-H1's last stage kept 4-7 micro-batches' activations instead of 1)."""
    import gc

    from pyparallel.pipeline_parallel import SavedTensorMeter
    from pyparallel.pipeline_parallel.split import backward_input

    torch.manual_seed(0)
    chunk = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    params = list(chunk.parameters())
    x = torch.randn(4, 16, requires_grad=True)
    meter = SavedTensorMeter(exclude=params)
    gc.disable()
    try:
        with meter:
            y = chunk(x)
        assert meter.live > 0
        gx, wpass = backward_input(y, torch.ones_like(y), x, params)
        del y
        wpass.run()
        del wpass
        assert meter.live == 0
    finally:
        gc.enable()
    ref = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    ref.load_state_dict(chunk.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).backward(torch.ones(4, 16))
    torch.testing.assert_close(gx, x2.grad, rtol=0, atol=0)
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ Hugging Face


def hf_model(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             tie_word_embeddings=True)
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg)


class WithLoss(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, idx, targets):
        from pyparallel.pipeline_parallel import token_cross_entropy

        return token_cross_entropy(self.lm(idx).logits, targets)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_blocks_compose_to_the_model(kind):
    model = hf_model(kind)
    blocks, loss_fn = to_blocks(model)
    assert len(blocks) == 5 and loss_fn is not None
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(0))
    x = ids
    for b in blocks:
        x = b(x)
    torch.testing.assert_close(x, model(ids).logits, rtol=0, atol=0)


def hf_body(kind, schedule):
    mesh = pyparallel.init(pp=2)
    cfg, _ = tiny_gpt(3)
    data = gpt_data(cfg, seqs=[12, 8, 16])
    ref = reference(lambda: WithLoss(hf_model(kind)), data)
    model = WithLoss(hf_model(kind))
    pipe = PipelineParallel(model.lm, mesh, schedule=schedule, num_microbatches=4)
    compare(model, pipe, train_pipe(pipe, data), ref)
    return len(pipe._tied)


def test_hf_parity():
    assert run(hf_body, 2, "llama", "1f1b") == [1, 1]  # tied embeddings across the two stages
    assert run(hf_body, 2, "gpt2", "gpipe") == [1, 1]


def test_token_vocab_reads_the_input_embedding_the_head_and_the_positions():
    """What every stage checks a batch against: the token embedding (not the position table), the LM head,
    the learned positions; a vocabulary-split embedding still gives the whole vocabulary."""
    from models import hf_model

    from pyparallel.tensor_parallel.layers import VocabParallelEmbedding

    gpt = GPT(gpt_config("tiny", **{**TINY, "vocab_size": 70}))
    assert token_vocab(to_blocks(gpt)[0]) == (70, 70, 16)
    assert token_vocab(to_blocks(hf_model("gpt2", vocab=66))[0]) == (66, 66, 32)
    assert token_vocab(to_blocks(hf_model("llama", vocab=66))[0]) == (66, 66, None)  # rotary: no table
    assert token_vocab(to_blocks(nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 9)))[0]) == (None, None, None)
    group = types.SimpleNamespace(size=2, rank=0, name="tp", ranks=(0, 1))  # the split itself needs no group
    mesh = types.SimpleNamespace(tp=2, tp_rank=0, tp_group=group, device=torch.device("cpu"))
    gpt.embed.wte = VocabParallelEmbedding.from_embedding(gpt.embed.wte, mesh)
    assert token_vocab(to_blocks(gpt)[0])[0] == 70
