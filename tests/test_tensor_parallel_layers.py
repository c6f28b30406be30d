"""Each tensor-parallel layer on t ranks equals the serial layer on the same input: output, input gradient
and (sliced) parameter gradients, at default fp32 tolerance; with and without sequence parallelism."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist import run

import pyparallel
from pyparallel.models.gpt import MLP, CausalSelfAttention, gpt_config
from pyparallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

B, S, H = 2, 8, 24
close = torch.testing.assert_close


def chunk(x, t, r, dim):
    return x.chunk(t, dim=dim)[r]


def serial(module, x, seed=3):
    """Output and gradients of the serial module for a fixed random output gradient."""
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    y = module(x)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    y.backward(gy)
    return y.detach(), gy, x.grad


def column_body(gather_output, sp):
    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    t, r = mesh.tp, mesh.tp_rank
    torch.manual_seed(0)
    full = nn.Linear(H, 6 * t)
    x = torch.randn(B, S, H)
    y, gy, gx = serial(full, x)
    layer = ColumnParallelLinear.from_linear(full, mesh, gather_output=gather_output, sequence_parallel=sp)
    xin = (chunk(x, t, r, 1) if sp else x).clone().requires_grad_()
    out = layer(xin)
    want = y if gather_output else chunk(y, t, r, -1)
    close(out, want)
    out.backward(gy if gather_output else chunk(gy, t, r, -1))
    close(xin.grad, chunk(gx, t, r, 1) if sp else gx)
    close(layer.weight.grad, chunk(full.weight.grad, t, r, 0))
    close(layer.bias.grad, chunk(full.bias.grad, t, r, 0))
    close(layer.full_parameters()["weight"], full.weight.detach())


def row_body(input_is_parallel, sp):
    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    t, r = mesh.tp, mesh.tp_rank
    torch.manual_seed(1)
    full = nn.Linear(8 * t, H)
    x = torch.randn(B, S, 8 * t)
    y, gy, gx = serial(full, x)
    layer = RowParallelLinear.from_linear(full, mesh, input_is_parallel=input_is_parallel, sequence_parallel=sp)
    xin = (chunk(x, t, r, -1) if input_is_parallel else x).clone().requires_grad_()
    out = layer(xin)
    close(out, chunk(y, t, r, 1) if sp else y)
    out.backward(chunk(gy, t, r, 1) if sp else gy)
    close(xin.grad, chunk(gx, t, r, -1) if input_is_parallel else gx)
    close(layer.weight.grad, chunk(full.weight.grad, t, r, 1))
    close(layer.bias.grad, full.bias.grad)  # summed over the sequence shards by the SP hook
    close(layer.full_parameters()["weight"], full.weight.detach())


def embedding_body(padding_idx, sp):
    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    t, r = mesh.tp, mesh.tp_rank
    torch.manual_seed(2)
    full = nn.Embedding(16 * t, H, padding_idx=padding_idx)
    idx = torch.randint(0, 16 * t, (B, S))
    idx[0, :3] = torch.tensor([0, 16 * t - 1, 16])  # both ends and a shard boundary
    y = full(idx)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    y.backward(gy)
    layer = VocabParallelEmbedding.from_embedding(full, mesh, sequence_parallel=sp)
    out = layer(idx)
    close(out, chunk(y, t, r, 1) if sp else y)
    out.backward(chunk(gy, t, r, 1) if sp else gy)
    close(layer.weight.grad, chunk(full.weight.grad, t, r, 0))


def mlp_body(approximate, sp):
    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    t, r = mesh.tp, mesh.tp_rank
    torch.manual_seed(4)
    full = MLP(gpt_config("tiny", n_embd=H, n_head=4, gelu_approximate=approximate))
    x = torch.randn(B, S, H)
    y, gy, gx = serial(full, x)
    layer = ParallelMLP.from_module(full, mesh, approximate=approximate, sequence_parallel=sp)
    xin = (chunk(x, t, r, 1) if sp else x).clone().requires_grad_()
    out = layer(xin)
    close(out, chunk(y, t, r, 1) if sp else y)
    out.backward(chunk(gy, t, r, 1) if sp else gy)
    close(xin.grad, chunk(gx, t, r, 1) if sp else gx)
    close(layer.fc_in.weight.grad, chunk(full.fc_in.weight.grad, t, r, 0))
    close(layer.fc_in.bias.grad, chunk(full.fc_in.bias.grad, t, r, 0))
    close(layer.fc_out.weight.grad, chunk(full.fc_out.weight.grad, t, r, 1))
    close(layer.fc_out.bias.grad, full.fc_out.bias.grad)


def attention_body(n_head, n_kv_head, sp):
    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    t, r = mesh.tp, mesh.tp_rank
    torch.manual_seed(5)
    cfg = gpt_config("tiny", n_embd=8 * n_head, n_head=n_head, n_kv_head=n_kv_head)
    full = CausalSelfAttention(cfg)
    x = torch.randn(B, S, cfg.n_embd)
    y, gy, gx = serial(full, x)
    layer = ParallelSelfAttention.from_module(full, mesh, n_head=n_head, n_kv_head=n_kv_head, sequence_parallel=sp)
    xin = (chunk(x, t, r, 1) if sp else x).clone().requires_grad_()
    out = layer(xin)
    close(out, chunk(y, t, r, 1) if sp else y)
    out.backward(chunk(gy, t, r, 1) if sp else gy)
    close(xin.grad, chunk(gx, t, r, 1) if sp else gx)
    for proj in ("q_proj", "k_proj", "v_proj"):
        close(getattr(layer, proj).weight.grad, chunk(getattr(full, proj).weight.grad, t, r, 0), msg=proj)
    close(layer.q_proj.bias.grad, chunk(full.q_proj.bias.grad, t, r, 0))
    close(layer.o_proj.weight.grad, chunk(full.o_proj.weight.grad, t, r, 1))
    close(layer.o_proj.bias.grad, full.o_proj.bias.grad)
    return layer.local_heads, layer.local_kv_heads


def cross_entropy_body():
    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    t, r = mesh.tp, mesh.tp_rank
    torch.manual_seed(6)
    logits = (3 * torch.randn(B * S, 10 * t)).requires_grad_()
    target = torch.randint(0, 10 * t, (B * S,))
    target[:3] = -100
    want = F.cross_entropy(logits, target)
    want.backward()
    local = chunk(logits.detach(), t, r, -1).clone().requires_grad_()
    pyparallel.reset_comm_stats()
    got = vocab_parallel_cross_entropy(local, target, mesh.tp_group)
    stats = pyparallel.comm_stats()["by_op_axis"]["all_reduce@tp"]
    close(got, want)
    got.backward()
    close(local.grad, chunk(logits.grad, t, r, -1))
    none = vocab_parallel_cross_entropy(local.detach(), target, mesh.tp_group, reduction="none")
    close(none, F.cross_entropy(logits.detach(), target, reduction="none"))
    return stats


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("gather_output,sp", [(False, False), (True, False), (False, True)])
def test_column_parallel_linear(world, gather_output, sp):
    run(column_body, world, gather_output, sp)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("input_is_parallel,sp", [(True, False), (False, False), (True, True)])
def test_row_parallel_linear(world, input_is_parallel, sp):
    run(row_body, world, input_is_parallel, sp)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("padding_idx,sp", [(None, False), (5, False), (None, True)])
def test_vocab_parallel_embedding(world, padding_idx, sp):
    run(embedding_body, world, padding_idx, sp)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("approximate,sp", [("tanh", False), ("none", False), ("tanh", True)])
def test_parallel_mlp(world, approximate, sp):
    run(mlp_body, world, approximate, sp)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_parallel_self_attention_gqa(world, sp):
    heads = run(attention_body, world, 8, 4, sp)  # grouped-query: 8 query heads, 4 KV heads
    assert heads[0] == (8 // world, 4 // world)


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_self_attention_mha(world):
    run(attention_body, world, 4, None, False)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy(world):
    stats = run(cross_entropy_body, world)
    # Two all-reduces (the max; the sum-exp and target logit stacked) of b·s and 2·b·s floats, never b·s·v.
    assert stats[0] == {"calls": 2, "payload_bytes": 3 * B * S * 4,
                        "wire_bytes": round(3 * B * S * 4 * 2 * (world - 1) / world)}


def _ref_linear(x, w, b, gy):
    """Plain-torch output and gradients of x @ w.T + b for the output gradient gy."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_() if b is not None else None
    y = F.linear(x, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def overlap_body():
    """The fused column/row functions (input-gradient reduction overlapped with the weight gradients,
    products reduced in place) against plain torch at odd sizes, plain and sequence-parallel, b = 3 (the
    rank-major copy) and b = 1 (a view); q/k/v as one group; and no tensor a user or autograd holds is
    ever written."""
    from pyparallel.tensor_parallel import copy_to_tp, reduce_from_tp
    from pyparallel.tensor_parallel.layers import InputCache, column_parallel_group

    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    t, r, group = mesh.tp, mesh.tp_rank, mesh.tp_group
    torch.manual_seed(7)  # the same full layers on every rank
    gen = torch.Generator().manual_seed(7)
    counts = {}
    for b, sp in ((3, False), (3, True), (1, True)):
        s, h = 3 * t, 7  # odd hidden size; per-rank widths 5, 3 and 3 (odd too)
        x = torch.randn(b, s, h, generator=gen)
        fulls = [nn.Linear(h, 5 * t), nn.Linear(h, 3 * t, bias=False), nn.Linear(h, 3 * t)]
        gys = [torch.randn(b, s, f.out_features, generator=gen) for f in fulls]
        refs = [_ref_linear(x, f.weight, f.bias, gy) for f, gy in zip(fulls, gys)]
        gx = sum(ref[1] for ref in refs)
        layers = [ColumnParallelLinear.from_linear(f, mesh, sequence_parallel=sp) for f in fulls]
        xin = (chunk(x, t, r, 1) if sp else x).clone().requires_grad_()
        before = xin.detach().clone()
        mine = [chunk(gy, t, r, -1).clone() for gy in gys]
        pyparallel.reset_comm_stats()
        outs = column_parallel_group(layers, xin)
        sum((o * g).sum() for o, g in zip(outs, mine)).backward()
        counts[(b, sp)] = {k: v["calls"] for k, v in pyparallel.comm_stats()["by_op"].items()}
        close(xin.detach(), before, rtol=0, atol=0)  # the user's input is never written
        close(xin.grad, chunk(gx, t, r, 1) if sp else gx)
        for layer, ref, out, f in zip(layers, refs, outs, fulls):
            close(out, chunk(ref[0], t, r, -1))
            close(layer.weight.grad, chunk(ref[2], t, r, 0))
            if f.bias is not None:
                close(layer.bias.grad, chunk(ref[3], t, r, 0))
        # One layer alone, and through an input cache with a lone reader (it reduces, the entry passes).
        for cache in (None, InputCache()):
            layer = ColumnParallelLinear.from_linear(fulls[0], mesh, sequence_parallel=sp, input_cache=cache)
            xin = (chunk(x, t, r, 1) if sp else x).clone().requires_grad_()
            layer(xin).backward(mine[0])
            close(xin.grad, chunk(refs[0][1], t, r, 1) if sp else refs[0][1])
            close(layer.weight.grad, chunk(refs[0][2], t, r, 0))
        # Row-parallel: the product summed in place (or reduce-scattered), the user's input untouched.
        full = nn.Linear(5 * t, h)
        xr = torch.randn(b, s, 5 * t, generator=gen)
        gy = torch.randn(b, s, h, generator=gen)
        y, gxr, gw, _ = _ref_linear(xr, full.weight, full.bias, gy)
        row = RowParallelLinear.from_linear(full, mesh, sequence_parallel=sp)
        xin = chunk(xr, t, r, -1).clone().requires_grad_()
        before = xin.detach().clone()
        g_in = (chunk(gy, t, r, 1) if sp else gy).clone()
        g_before = g_in.clone()
        out = row(xin)
        out.backward(g_in)
        close(out, chunk(y, t, r, 1) if sp else y)
        close(xin.detach(), before, rtol=0, atol=0)
        close(g_in, g_before, rtol=0, atol=0)
        close(xin.grad, chunk(gxr, t, r, -1))
        close(row.weight.grad, chunk(gw, t, r, 1))

    # Aliasing: autograd hands one gradient tensor to both addends of y + u; f's backward must not
    # reduce it in place (u.grad would be all-reduced too), nor the fused column layer's.
    layer = ColumnParallelLinear.from_linear(nn.Linear(7, 3 * t), mesh)
    g = torch.full((2, 3), float(r + 1))  # different on every rank: a stray all-reduce shows
    x = torch.randn(2, 3, requires_grad=True)
    u = torch.zeros(2, 3, requires_grad=True)
    (copy_to_tp(x, group) + u).backward(g)
    close(g, torch.full((2, 3), float(r + 1)), rtol=0, atol=0)  # the caller's gradient, unchanged
    close(u.grad, g, rtol=0, atol=0)
    close(x.grad, torch.full((2, 3), float(t * (t + 1) // 2)), rtol=0, atol=0)
    xl = torch.randn(2, 7, requires_grad=True)
    u = torch.zeros(2, 3, requires_grad=True)
    (layer(xl) + u).backward(g)
    close(u.grad, g, rtol=0, atol=0)
    close(g, torch.full((2, 3), float(r + 1)), rtol=0, atol=0)
    # g's forward on a tensor the user holds: summed into a copy, never in place.
    p = torch.full((4,), float(r + 1))
    close(reduce_from_tp(p, group), torch.full((4,), float(t * (t + 1) // 2)))
    close(p, torch.full((4,), float(r + 1)), rtol=0, atol=0)
    return counts


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_backward_and_in_place_reductions(world):
    counts = run(overlap_body, world)[0]
    # q/k/v as one group: one input-gradient reduction for all three (and no all-reduce in forward).
    assert counts[(3, False)] == {"all_reduce": 1}
    assert counts[(3, True)] == {"all_gather": 1, "reduce_scatter": 1}
