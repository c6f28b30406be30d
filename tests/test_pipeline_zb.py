"""Zero-bubble schedules (ZB-H1, ZBV; Qi et al. 2023): the B/W split equals the full backward bit for bit,
the schedules are deadlock-free with their theoretical bubble, and the pipeline equals one process and
1F1B (built-in GPT at p = 2 and 4, a Hugging Face model, activation checkpointing, tied weights)."""

import pytest
import torch
import torch.nn as nn
from dist import run
from test_pipeline import compare, gpt_data, reference, tiny_gpt, train_pipe

import pyparallel
from pyparallel import comm
from pyparallel.pipeline_parallel import PipelineParallel, schedules
from pyparallel.pipeline_parallel.split import backward_input
from pyparallel.pipeline_parallel.stage import Chunk

# -------------------------------------------------------------------------------- no processes needed


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_zero_bubble_lists_are_valid_and_beat_1f1b(schedule):
    for p in (2, 3, 4, 8):
        v = schedules.chunks_per_stage(schedule, 1)
        for m in (p, 2 * p, 4 * p):
            sim = schedules.simulate(schedule, p, m)  # raises on a deadlock
            one_f_one_b = schedules.theoretical_bubble(p, m)
            if schedule == "zb-h1":  # Qi et al.: bubble (p-1)(T_F + T_B - T_W) = a third of 1F1B's time
                assert sim["bubble"] == pytest.approx((p - 1) / (3 * m + p - 1))
            else:
                assert sim["bubble"] < schedules.theoretical_bubble(p, m, schedule="zb-h1")
            assert sim["bubble"] < one_f_one_b
            for r in range(p):
                # 1F1B's activation memory: p micro-batches of a whole stage (2p half-stage chunks)
                assert sim["peak_inflight"][r] <= p * v
                actions = schedules.build(schedule, r, p, m)
                mine = [c for c in range(p * v) if schedules.stage_of(schedule, c, p) == r]
                assert sorted(actions) == sorted(schedules.Action(k, c, i) for k in "FBW" for c in mine
                                                 for i in range(m))
                for c in mine:  # each chunk's W's follow their B's, in micro-batch order
                    ws = [a.mb for a in actions if a.kind == "W" and a.chunk == c]
                    assert ws == list(range(m))
                    for i in range(m):
                        assert actions.index(schedules.Action("B", c, i)) < actions.index(
                            schedules.Action("W", c, i))
    assert [schedules.stage_of("zbv", c, 4) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_zbv_messages_have_receivers_in_order():
    p, m, schedule = 4, 8, "zbv"
    lists = [schedules.build(schedule, r, p, m) for r in range(p)]
    place = [schedules.stage_of(schedule, c, p) for c in range(2 * p)]
    for src in range(p):
        for dst in range(p):
            if src == dst:
                continue
            msgs = schedules.messages_from(lists[src], src, dst, p, 2 * p, schedule)
            data = sorted(k for k in msgs if k[0] != "meta")
            needed = sorted([("act", a.chunk - 1, a.mb) for a in lists[dst]
                             if a.kind == "F" and a.chunk > 0 and place[a.chunk - 1] == src]
                            + [("grad", a.chunk, a.mb) for a in lists[dst]
                               if a.kind == "B" and a.chunk + 1 < 2 * p and place[a.chunk + 1] == src])
            assert data == needed


class TwiceShared(nn.Module):
    """A layer whose weight is used twice in one chunk (the W group with two intermediates)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("kind", ["gpt", "shared"])
def test_split_backward_equals_full_backward_bitwise(kind, split_analysis):
    torch.manual_seed(0)
    if kind == "gpt":
        cfg, make = tiny_gpt(3)

        def build():
            return Chunk(list(make().blocks[:2]), 1, 1)
        shape = (2, 8, cfg.n_embd)
    else:
        def build():
            torch.manual_seed(1)
            return Chunk([TwiceShared(), nn.LayerNorm(16)], 1, 1)
        shape = (4, 16)
    full, split = build(), build()
    fires = {}
    for n, q in split.named_parameters():
        q.register_post_accumulate_grad_hook(lambda _q, n=n: fires.__setitem__(n, fires.get(n, 0) + 1))
    for step in range(3):  # the second and third accumulate into existing .grad
        x0, g = torch.randn(shape), torch.randn(shape)
        xa = x0.clone().requires_grad_()
        torch.autograd.backward(full(xa), g)
        xb = x0.clone().requires_grad_()
        gx, wpass = backward_input(split(xb), g, xb, list(split.parameters()))
        assert torch.equal(gx, xa.grad)
        assert all(q.grad is None for q in split.parameters()) if step == 0 else True  # B left W alone
        groups, direct = wpass.num_groups, wpass.num_direct
        wpass.run()
        for (n, a), b in zip(full.named_parameters(), split.parameters()):
            assert torch.equal(a.grad, b.grad), n
    assert fires == {n: 3 for n, _ in split.named_parameters()}  # once per parameter per backward
    # Every group of the GPT's blocks is one Linear or LayerNorm node: W skips the engine for all of them;
    # the weight used twice (two intermediates) goes through the engine, the LayerNorm does not.
    assert direct == (groups if kind == "gpt" else 1) and groups > 1


def test_direct_weight_pass_keeps_grad_buffers_and_tensor_hooks(split_analysis):
    """W's direct path (split.py, "Direct W") adds into an existing ``.grad`` in place — here views of one
    flat buffer, as pyparallel's DP and ZeRO engines give — bit for bit as a full backward, and leaves a
    parameter with a tensor hook to the engine, which runs the hook once per backward."""
    def build():
        torch.manual_seed(1)
        return Chunk([nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16, bias=False), nn.LayerNorm(16)], 1, 1)

    full, split = build(), build()
    flats = []
    for chunk in (full, split):
        params = list(chunk.parameters())
        flat = torch.zeros(sum(q.numel() for q in params))
        for q, view in zip(params, torch.split(flat, [q.numel() for q in params])):
            q.grad = view.view_as(q)
        flats.append(flat)
        chunk.blocks[0].weight.register_hook(lambda g: g * 2)  # the engine must apply it
    ptrs = [q.grad.data_ptr() for q in split.parameters()]
    calls = []
    split.blocks[0].weight.register_hook(lambda g: calls.append(1))
    torch.manual_seed(0)
    for _ in range(3):
        x0, g = torch.randn(5, 7, 16), torch.randn(5, 7, 16)
        xa = x0.clone().requires_grad_()
        torch.autograd.backward(full(xa), g)
        xb = x0.clone().requires_grad_()
        gx, wpass = backward_input(split(xb), g, xb, list(split.parameters()))
        assert (wpass.num_groups, wpass.num_direct) == (3, 3)  # the hooked Linear falls back at run time
        wpass.run()
        assert torch.equal(gx, xa.grad)
        assert torch.equal(flats[0], flats[1])
    assert [q.grad.data_ptr() for q in split.parameters()] == ptrs
    assert len(calls) == 3


def _graphs():
    """(output, input, parameters) of chunks whose W groups differ in shape: GPT blocks ending in the tied
    head and the loss, a weight used twice, a Hugging Face Llama chunk (RMSNorm, rotary), and a parameter
    reached only off the input's path (a bias added to a constant)."""
    import transformers as tf

    from pyparallel.pipeline_parallel import to_blocks, token_cross_entropy

    torch.manual_seed(0)
    cfg, make = tiny_gpt(2)
    model = make()
    blocks, _ = to_blocks(model)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    x = blocks[0](idx).detach().requires_grad_()
    y = x
    for b in blocks[1:]:
        y = b(y)
    yield token_cross_entropy(y, idx), x, list(model.parameters())
    shared = nn.Sequential(TwiceShared(), nn.LayerNorm(16))
    x = torch.randn(4, 16, requires_grad=True)
    yield shared(x), x, list(shared.parameters())
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=16))
    x = torch.randn(2, 8, 32, requires_grad=True)
    y = llama.lm_head(llama.model(inputs_embeds=x).last_hidden_state)
    yield y, x, list(llama.parameters())
    lin, off = nn.Linear(16, 16), nn.Parameter(torch.randn(16))
    x = torch.randn(4, 16, requires_grad=True)
    yield lin(x) * (torch.ones(16) + off), x, [*lin.parameters(), off]


def test_native_split_plan_equals_the_python_analysis():
    """The C++ analysis (pyparallel._C.split_plan) finds the Python reference's groups — the same
    intermediates, in the same order, each with the same parameters — and its hooks capture the same
    gradients during B."""
    from pyparallel.pipeline_parallel import split

    native = split._native()
    if native is None:
        pytest.skip("pyparallel._C is not built: only the Python analysis exists")
    for y, x, params in _graphs():
        nodes = split.param_nodes_of(params)
        ref = split._analyse(y.grad_fn, split._node_of(x), nodes)
        plist = list(nodes.values())
        found, capture = native.split_plan(y, x, plist)
        assert [[id(n) for n in g.intermediates] for g in ref] == [[id(n) for n in i] for i, _ in found]
        assert [{id(q) for q in g.params} for g in ref] == [{id(plist[k]) for k in q} for _, q in found]
        assert len(ref) > 0
        seen = {}
        hooks = [n.register_prehook(lambda grads, n=n, seen=seen: seen.__setitem__(n, grads))
                 for g in ref for n in g.intermediates]
        torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
        for h in hooks:
            h.remove()
        grads = capture.take()
        for n, got in zip((n for g in ref for n in g.intermediates), grads):
            want = seen.get(n)
            assert (got is None) == (want is None)
            if got is not None:
                assert len(got) == len(want)
                assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
        assert capture.take() == [], "take() hands the gradients over once"


# --------------------------------------------------------------------------------- parity (processes)


def _grads_by_name(model, pipe, group):
    """{parameter name: gradient} over the whole pipeline (each rank's own, gathered)."""
    mine = {id(q) for q in pipe.parameters()}
    local = {n: q.grad.clone() for n, q in model.named_parameters() if id(q) in mine and q.grad is not None}
    out = {}
    for part in comm.all_gather_object(local, group):
        for n, g in part.items():
            out[n] = g if n not in out else out[n]  # a tied copy: every holder has the summed gradient
    return out


def zb_body(pp, n_layer, configs, tie=True):
    """Per config: one step's gradients against 1F1B's (bit for bit except where noted), then 5 SGD steps
    of changing sequence length against one process."""
    mesh = pyparallel.init(pp=pp)
    cfg, make = tiny_gpt(n_layer, tie_embeddings=tie)
    data = gpt_data(cfg)
    ref = reference(make, data)
    base_model = make()
    base = PipelineParallel(base_model, mesh, schedule="1f1b", num_microbatches=configs[0][1])
    base.step(*data[0])
    want = _grads_by_name(base_model, base, mesh.pp_group)
    out = []
    for schedule, m, ckpt in configs:
        model = make()
        pipe = PipelineParallel(model, mesh, schedule=schedule, num_microbatches=m, activation_checkpointing=ckpt)
        if m == configs[0][1]:
            pipe.step(*data[0])
            got = _grads_by_name(model, pipe, mesh.pp_group)
            assert set(got) == set(want)
            tied_here = {"head.lm_head.weight", "embed.wte.weight"} if tie and schedule == "zbv" else set()
            for n, g in want.items():
                if n in tied_here:  # both uses on rank 0: summed in another order than 1F1B's all-reduce
                    torch.testing.assert_close(got[n], g, rtol=1e-6, atol=1e-7)
                else:
                    assert torch.equal(got[n], g), n
            pipe.zero_grad()
            pipe.reset_stats()
        losses = train_pipe(pipe, data)
        compare(model, pipe, losses, ref)
        st = pipe.stats()
        out.append({"peak": st["peak_inflight"], "limit": st["inflight_limit"], "split": st["split"],
                    "tied": len(pipe._tied), "bubble": st["bubble_measured"], "theory": st["bubble_theory"],
                    "sim": st["bubble_simulated"], "steps": st["stages"][mesh.pp_rank]["steps"],
                    "microbatches": st["stages"][mesh.pp_rank]["microbatches"],
                    "timed": sorted(st["stages"][mesh.pp_rank]["action_s"]),
                    "chunks": sorted(pipe.chunks)})
    return out


ZB_CONFIGS = [("zb-h1", 4, False), ("zbv", 4, False), ("zb-h1", 8, False), ("zbv", 8, False)]


@pytest.mark.parametrize("pp,n_layer", [(2, 3), (4, 6)])  # 5 blocks on 2 stages; 8 blocks on 4 (zbv: 8 chunks)
def test_zero_bubble_parity(pp, n_layer):
    results = run(zb_body, pp, pp, n_layer, ZB_CONFIGS)
    for rank, per_config in enumerate(results):
        for (schedule, m, _), r in zip(ZB_CONFIGS, per_config):
            assert r["peak"][rank] <= r["limit"][rank] <= pp * (2 if schedule == "zbv" else 1)
            # zbv puts the first and last chunk (wte, lm_head) on rank 0: no cross-stage tie left
            assert r["tied"] == (0 if schedule == "zbv" else int(rank in (0, pp - 1)))
            split = r["split"][rank]
            assert split["full_checkpointed"] == 0
            first_chunks = 1  # chunk 0 has token ids as input: its B is empty, W is the whole backward
            assert split["no_input_grad"] == (m * first_chunks if rank == 0 else 0)
            assert split["split"] == m * (2 if schedule == "zbv" else 1) - split["no_input_grad"]
            assert 0.0 <= r["bubble"] < 1.0 and r["theory"] < (pp - 1) / (m + pp - 1)
            # every action of this stage's chunks was timed, per micro-batch, and replayed
            assert r["timed"] == sorted(f"{k}{c}" for k in "FBW" for c in r["chunks"])
            assert r["microbatches"] == r["steps"] * m and 0.0 <= r["sim"] < 1.0


def test_zero_bubble_parity_checkpointing_and_untied():
    configs = [("zbv", 4, True), ("zb-h1", 4, True)]
    results = run(zb_body, 2, 2, 3, configs, False)
    for rank, per_config in enumerate(results):
        for r in per_config:
            split = r["split"][rank]
            assert split["split"] == 0 and split["full_checkpointed"] + split["no_input_grad"] > 0


def hf_zb_body(schedule):
    from test_pipeline_units import WithLoss, hf_model

    mesh = pyparallel.init(pp=2)
    cfg, _ = tiny_gpt(3)
    data = gpt_data(cfg, seqs=[12, 8, 16])
    ref = reference(lambda: WithLoss(hf_model("llama")), data)
    model = WithLoss(hf_model("llama"))
    pipe = PipelineParallel(model.lm, mesh, schedule=schedule, num_microbatches=4)
    compare(model, pipe, train_pipe(pipe, data), ref)
    return pipe.stats()["split"][mesh.pp_rank]


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_zero_bubble_hf_parity(schedule):
    first, second = run(hf_zb_body, 2, schedule)
    # zb-h1: rank 0 holds only the embedding chunk (nothing to split), rank 1 splits every B;
    # zbv: rank 0 also holds the last chunk, whose B it splits.
    assert first["no_input_grad"] == 4 and first["split"] == (4 if schedule == "zbv" else 0)
    assert second["split"] == (8 if schedule == "zbv" else 4) and second["no_input_grad"] == 0


def frozen_first_chunk_body(configs):
    """The embedding frozen and alone in chunk 0 (untied GPT): chunk 0's output needs no gradient, so no
    gradient crosses boundary 0 and stage 0 never takes one; the step must still consume its whole message
    order. Per (schedule, boundaries): 5 SGD steps against one process, and the split counts."""
    mesh = pyparallel.init(pp=2)
    cfg, make_gpt = tiny_gpt(3, tie_embeddings=False)

    def make():
        model = make_gpt()
        model.embed.requires_grad_(False)
        return model

    data = gpt_data(cfg)
    ref = reference(make, data)
    out = []
    for schedule, boundaries in configs:
        model = make()
        pipe = PipelineParallel(model, mesh, schedule=schedule, num_microbatches=4, boundaries=boundaries)
        if mesh.pp_rank == 0:
            assert not any(q.requires_grad for q in pipe.chunks[0].parameters())
        compare(model, pipe, train_pipe(pipe, data), ref)
        out.append(pipe.stats()["split"][mesh.pp_rank])
    return out


def test_frozen_first_chunk_sends_no_gradient_and_trains_like_one_process():
    # 5 blocks (embed, 3 layers, head); chunk 0 is the frozen embedding alone in every config
    configs = [("1f1b", [0, 1, 5]), ("zb-h1", [0, 1, 5]), ("zbv", [0, 1, 2, 4, 5])]
    first, second = run(frozen_first_chunk_body, 2, configs)
    assert first[0] is None and second[0] is None  # 1F1B: no split
    assert first[1]["no_input_grad"] == 4 and first[1]["split"] == 0  # zb-h1: the frozen chunk 0
    assert first[2]["no_input_grad"] == 4 and first[2]["split"] == 4  # zbv: chunk 0, and chunk 3 (the head)
    # the chunk after the frozen one gets an input that needs no gradient: its B has nothing to compute
    assert second[1]["no_input_grad"] == 4 and second[1]["split"] == 0  # zb-h1: chunk 1 on rank 1
    assert second[2]["no_input_grad"] == 4 and second[2]["split"] == 4  # zbv: chunks 1 and 2 on rank 1
