"""ZeRO's model-state bytes per rank match the paper's formulas; its bytes per step are 2Ψ (stages 1-2) and
3Ψ (stage 3; less the last unit of the forward, whose weights stay gathered into the backward).

Memory (Rajbhandari et al. 2020, figure 1): with Ψ parameters, N ranks and mixed-precision Adam, DDP holds
16Ψ, ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N. The paper reduces and stores gradients in the
16-bit compute dtype. Stages 1-2 match it exactly with ``reduce_dtype=torch.bfloat16`` (fp32 reductions
cost stage 2 4Ψ/N of gradient shard instead of 2Ψ/N; stage 1's reduced shard exists only from the
reduction to ``zero_grad()`` and is listed as a buffer). Stage 3 keeps no bf16 weights at rest (each
all-gather casts the fp32 master's slice), so it matches 16Ψ/N with the default fp32 gradient shard and
holds 14Ψ/N with bf16 reductions. Ψ is counted with ZeRO's padding (each flat group rounded up to a
multiple of N) and the optimizer's scalar ``step`` tensor (4 bytes) is the only other state.
"""

import contextlib

import pytest
import torch
from dist import run

import pyparallel
from pyparallel import memory, zero
from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch

CFG = gpt_config("tiny")  # the built-in GPT preset (tied embedding / LM head)
STEP = 4  # AdamW's state["step"]: one fp32 scalar per optimizer tensor


def _one_step(model, opt, rank=0, world=1):
    idx, tgt = synthetic_batch(CFG, 2 * world, 16, seed=3)
    loss = model(idx[2 * rank:2 * rank + 2], tgt[2 * rank:2 * rank + 2])
    loss.backward()
    opt.step()
    opt.zero_grad()


def paper(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def memory_body():
    mesh = pyparallel.init()
    n, rank = mesh.dp, mesh.dp_rank
    psi = GPT(CFG).num_params()
    out = {}
    for stage in (1, 2, 3):
        for reduce_dtype in (torch.bfloat16, torch.float32):
            model, opt = zero.setup(GPT(CFG), mesh, stage=stage, optimizer=torch.optim.AdamW, lr=1e-3,
                                    param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, bucket_cap_mb=0.05)
            _one_step(model, opt, rank, n)
            rep = memory.model_state_bytes(model, opt)
            psi_pad, s = model.engine.space.padded_numel, model.engine.space.numel
            STEP_SCALAR = STEP * len(model.engine.runs)  # one step count per optimizer tensor (run)
            assert psi_pad == s * n and rep["padding_elements"] == psi_pad - psi
            assert rep["optimizer"] == 8 * s + STEP_SCALAR and rep["master"] == 4 * s
            rb = 2 if reduce_dtype == torch.bfloat16 else 4
            if stage == 1:  # the reduced shard lives from the reduction to zero_grad(): a buffer
                assert rep["buffers"]["reduced_grad_shard"] == rb * s
                expected = 4 * psi_pad + 12 * s  # the paper's 4Ψ + 12Ψ/N with either reduce dtype
            elif stage == 2:
                expected = 2 * psi_pad + (12 + rb) * s  # bf16 reductions: the paper's 2Ψ + 14Ψ/N
            else:  # no bf16 weights at rest (each gather casts the master): fp32 grads give the paper's 16Ψ/N
                assert rep["params"] == 0 and "gather_cast_shards" in rep["buffers"]
                expected = (12 + rb) * s
            assert rep["model_states"] == expected + STEP_SCALAR, (stage, reduce_dtype, rep)
            assert rep["model_states"] <= paper(stage, psi_pad, n) + 2 * s + STEP_SCALAR
            if stage < 3 and reduce_dtype == torch.bfloat16 or stage == 3 and reduce_dtype == torch.float32:
                # the paper's figure, against the unpadded Ψ
                assert abs(rep["model_states"] - paper(stage, psi, n)) <= 16 * (psi_pad - psi) + STEP_SCALAR
            assert rep["buffers"] and rep["total"] == rep["model_states"] + rep["buffers_total"]
            out[(stage, str(reduce_dtype))] = rep["model_states"]
        # fp32 training keeps no separate master copy: the fp32 analogue of the paper's figures, exactly
        # (4 bytes of weights + 4 of gradients + 8 of Adam moments per parameter).
        model, opt = zero.setup(GPT(CFG), mesh, stage=stage, optimizer=torch.optim.AdamW, lr=1e-3, bucket_cap_mb=0.05)
        _one_step(model, opt, rank, n)
        rep = memory.model_state_bytes(model, opt)
        psi_pad, s = model.engine.space.padded_numel, model.engine.space.numel
        steps = STEP * len(model.engine.runs)
        assert rep["master"] == 0 and rep["optimizer"] == 8 * s + steps, (stage, rep)
        fp32 = {1: 8 * psi_pad + 8 * s, 2: 4 * psi_pad + 12 * s, 3: 16 * s}[stage]
        assert rep["model_states"] == fp32 + steps, (stage, rep)
    # DDP (fp32 Adam, the paper's 16Ψ) and a plain module with a torch optimizer.
    ddp = pyparallel.DataParallel(GPT(CFG), mesh)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    _one_step(ddp, opt, rank, n)
    k = len(list(ddp.parameters()))
    rep = memory.model_state_bytes(ddp, opt)
    assert rep["model_states"] == 16 * psi + STEP * k, rep
    plain = GPT(CFG)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    _one_step(plain, opt)
    assert memory.model_state_bytes(plain, opt)["model_states"] == 16 * psi + STEP * k
    out["ddp"] = rep["model_states"]
    return out, psi


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_bytes_match_the_paper(world):
    per_rank, psi = run(memory_body, world)[0]
    bf16 = str(torch.bfloat16)
    # ZeRO-3 < ZeRO-2 < ZeRO-1 < DDP, by about the paper's ratios.
    assert per_rank[(3, bf16)] < per_rank[(2, bf16)] < per_rank[(1, bf16)] < per_rank["ddp"]
    assert per_rank[(3, str(torch.float32))] == pytest.approx(16 * psi / world, rel=0.02)


def comm_body(tie):
    mesh = pyparallel.init()
    n, rank = mesh.dp, mesh.dp_rank
    cfg_model = lambda: GPT(gpt_config("tiny", tie_embeddings=tie))  # noqa: E731
    out = {}
    for stage in (1, 2, 3):
        model, opt = zero.setup(cfg_model(), mesh, stage=stage, optimizer=torch.optim.AdamW, lr=1e-3,
                                bucket_cap_mb=0.05)
        _one_step(model, opt, rank, n)  # stage 3 learns the forward order in the first step
        pyparallel.reset_comm_stats()
        _one_step(model, opt, rank, n)
        stats = pyparallel.comm_stats()["by_op_axis"]
        eng = model.engine
        units = [lay.padded for lay in eng.layouts]
        gat = eng.gatherer
        root = gat.root.layout.padded if stage == 3 and gat.root is not None else 0
        last = sum(eng.layouts[i].padded for i in gat._keep) if stage == 3 else 0  # gathered from forward to backward
        out[stage] = (stats, units, root, last)
    ddp = pyparallel.DataParallel(cfg_model(), mesh)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    pyparallel.reset_comm_stats()
    _one_step(ddp, opt, rank, n)
    out["ddp"] = pyparallel.comm_stats()["by_op_axis"]
    return out, GPT(gpt_config("tiny", tie_embeddings=tie)).num_params()


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step(world):
    for tie in (False, True):
        out, psi = run(comm_body, world, tie)[0]
        for stage in (1, 2, 3):
            stats, units, root, last = out[stage]
            psi_pad = sum(units)
            # Nothing else per step but the non-finite check: one all-reduce of (flag, squared norm) in fp64.
            assert set(stats) == {"reduce_scatter@dp", "all_gather@dp", "all_reduce@dp"}, stats
            assert stats.pop("all_reduce@dp")["payload_bytes"] == 2 * 8
            rs, ag = stats["reduce_scatter@dp"], stats["all_gather@dp"]
            assert rs["payload_bytes"] == 4 * psi_pad  # every gradient element reduced once
            gathers = 1 if stage < 3 else 2  # stage 3: before forward and again before backward
            assert ag["payload_bytes"] == 4 * (gathers * psi_pad - root - last)
            if stage == 3 and not tie:
                assert root == 0 and 0 < last < psi_pad / 2
                assert rs["payload_bytes"] + ag["payload_bytes"] == 4 * (3 * psi_pad - last)  # 3Ψ less one unit
            if stage < 3:
                assert rs["payload_bytes"] + ag["payload_bytes"] == 2 * 4 * psi_pad  # 2Ψ
            for op in (rs, ag):
                assert op["wire_bytes"] == pytest.approx((world - 1) / world * op["payload_bytes"], abs=op["calls"])
            assert psi_pad - psi < world * len(units)
        # Stages 1-2 put as many bytes on the wire as DDP's all-reduce (up to padding).
        ddp = out["ddp"]["all_reduce@dp"]["wire_bytes"]
        zero1 = sum(v["wire_bytes"] for v in out[1][0].values())
        assert zero1 == pytest.approx(ddp, rel=0.01)


def in_place_body():
    from pyparallel import comm

    mesh = pyparallel.init()
    g, n, r = mesh.dp_group, mesh.dp, mesh.dp_rank
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("sum", "avg"):
            x = torch.randn(n * 7, generator=torch.Generator().manual_seed(r)).to(dtype)  # odd slice size
            expected = torch.empty(7, dtype=dtype)
            comm.reduce_scatter(expected, x.clone(), g, op=op)
            pyparallel.reset_comm_stats()
            comm.reduce_scatter_in_place(x, g, op=op, async_op=True).wait()
            torch.testing.assert_close(x.view(n, 7)[r], expected)
            stats = pyparallel.comm_stats()["by_op_axis"]
            assert stats == {"reduce_scatter@dp": {"calls": 1, "payload_bytes": x.numel() * x.element_size(),
                                                   "wire_bytes": round((n - 1) / n * x.numel() * x.element_size())}}
    return True


def test_reduce_scatter_in_place_matches_reduce_scatter():
    assert all(run(in_place_body, 4))


def root_release_body(mode):
    """When stage 3 lets the root unit's gathered weights go, relative to the head's and the embedding's
    backward, for two steps of the tied GPT."""
    from pyparallel.zero.flat_param import storage_allocated

    mesh = pyparallel.init()
    model, opt = zero.setup(GPT(CFG), mesh, stage=3, optimizer=torch.optim.AdamW, lr=1e-3)
    gatherer = model.engine.gatherer
    events, records, user = [], [], {"pack": 0, "unpack": 0}
    release = gatherer._release_root

    materialize = gatherer._materialize

    def spy(record):
        events.append("release")
        release(record)

    def gathered(unit):  # the root's weights of each step
        record = materialize(unit)
        if unit is gatherer.root:
            records.append(record)
        return record

    gatherer._release_root, gatherer._materialize = spy, gathered

    def on_output(name):
        def hook(module, args, out):
            out.register_hook(lambda g: events.append(name))
        return hook

    net = model.module
    net.embed.register_forward_hook(on_output("embed grad"))  # the embedding's backward runs after this
    net.head.register_forward_hook(on_output("head grad"))

    def user_pack(t):  # the user's own saved-tensor hooks around the call (as save_on_cpu would be)
        user["pack"] += 1
        return t.detach()

    def user_unpack(t):
        user["unpack"] += 1
        return t

    idx, tgt = synthetic_batch(CFG, 2, 16, seed=mesh.dp_rank)
    steps = []
    for _ in range(2):
        events.clear()
        if mode == "user hooks":
            ctx = torch.autograd.graph.saved_tensors_hooks(user_pack, user_unpack)
        elif mode == "hooks disabled":  # entering saved-tensor hooks raises there: the root stays instead
            ctx = torch.autograd.graph.disable_saved_tensors_hooks("not here")
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            loss = model(idx, tgt)
        forward_events = list(events)
        if mode != "no backward":
            loss.backward(retain_graph=mode == "retain_graph")
        backward_events = list(events)
        del loss  # the graph goes here, with its saved tensors if backward did not release them
        after = list(events)
        if mode != "no backward":
            opt.step()
        opt.zero_grad()
        steps.append((forward_events, backward_events, after, storage_allocated(records[-1].full)))
    return steps, user


@pytest.mark.parametrize("mode", ["backward", "retain_graph", "no backward", "user hooks", "hooks disabled"])
def test_zero3_frees_the_root_weights_once_the_head_backward_is_done(mode):
    """The root unit (embeddings, final norm, the tied head) is read at both ends of the forward, so stage 3
    gathers it once for the step; its weights are needed in backward only by what saved them (the head's
    matmul, the final norm), so they go once autograd releases those, before the embedding's backward adds
    a root-sized gradient of its own (the planner's 2 x root). With ``retain_graph``, or a forward that is
    never backpropagated, they stay until the graph is dropped -- and the graph is dropped (a saved-tensor
    hook that kept a saved output's grad_fn would leak it). The user's own saved-tensor hooks still see
    every saved tensor; where the user disabled saved-tensor hooks the weights stay to the root's backward."""
    for steps, user in run(root_release_body, 2, mode):
        for forward_events, backward_events, after, allocated in steps:
            assert forward_events == []  # the head's matmul saved the weights: nothing freed in forward
            if mode in ("backward", "user hooks"):
                assert backward_events == ["head grad", "release", "embed grad"]
                assert after == backward_events
            elif mode == "hooks disabled":  # held to the root's post-backward, as before the early release
                assert backward_events == ["head grad", "embed grad"] and after == backward_events
            elif mode == "retain_graph":
                assert backward_events == ["head grad", "embed grad"]
                assert after == ["head grad", "embed grad", "release"]
            else:
                assert backward_events == [] and after == ["release"]
            assert not allocated
        if mode == "user hooks":
            assert user["pack"] > 20 and user["unpack"] == user["pack"]  # every saved tensor, each used once
        else:
            assert user == {"pack": 0, "unpack": 0}
