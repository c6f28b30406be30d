"""DataParallel equals one process on the whole batch; its bytes are the gradient bytes; bad input fails."""

import pytest
import torch
import torch.distributed as dist
from dist import run
from models import Net, adamw, batches

import pyparallel
from pyparallel import comm

STEPS = 10


def reference(steps, batch, **net_kw):
    model = Net(**net_kw)
    opt = adamw(model)
    losses = []
    for idx, tgt in batches(steps, batch):
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def ddp_parity_body(batch, micro, net_kw, ddp_kw):
    mesh = pyparallel.init()
    rank, world = mesh.dp_rank, mesh.dp
    torch.manual_seed(1234 + rank)  # ranks start from different weights: the wrap must broadcast rank 0's
    model = Net(**net_kw)
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            for b in model.buffers():
                b.fill_(7.0)
    ddp = pyparallel.DataParallel(model, mesh, bucket_cap_mb=0.004, **ddp_kw)  # ~4 KB: many buckets
    opt = adamw(model)
    local = batch // world
    losses = []
    for idx, tgt in batches(STEPS, batch):
        idx, tgt = idx[rank * local:(rank + 1) * local], tgt[rank * local:(rank + 1) * local]
        total = 0.0
        for m in range(micro):
            sl = slice(m * local // micro, (m + 1) * local // micro)
            ctx = ddp.no_sync() if m < micro - 1 else _null()
            with ctx:
                loss = ddp(idx[sl], tgt[sl]) / micro
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([total])
        comm.all_reduce(t, mesh.dp_group, op="avg")
        losses.append(t.item())
    ref_losses, ref_params = reference(STEPS, batch, **net_kw)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[n], msg=f"parameter {n} after {STEPS} steps")
    return len(ddp.buckets)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("world", [2, 4])
def test_parity(world):
    nb = run(ddp_parity_body, world, 8, 1, {}, {})
    assert nb[0] > 3  # the small cap really produced several buckets


@pytest.mark.parametrize("world", [2, 4])
def test_parity_no_sync_accumulation(world):
    run(ddp_parity_body, world, 16, 4, {}, {})


def test_parity_unused_parameter_and_buffer():
    run(ddp_parity_body, 2, 8, 1, {"unused": True, "buffer": True}, {"find_unused_parameters": True})


def unused_without_flag_body():
    mesh = pyparallel.init()
    model = Net(unused=True)
    ddp = pyparallel.DataParallel(model, mesh)
    idx, tgt = batches(1, 4)[0]
    with pytest.raises(RuntimeError, match=r"unused\.weight.*find_unused_parameters=True"):
        ddp(idx, tgt).backward()
    # The step's reductions completed on every rank: the group is still usable.
    t = torch.ones(1)
    comm.all_reduce(t, mesh.dp_group)
    return t.item()


def test_unused_parameter_without_flag_names_it():
    assert run(unused_without_flag_body, 2) == [2.0, 2.0]


def accounting_body():
    mesh = pyparallel.init()
    model = Net()
    ddp = pyparallel.DataParallel(model, mesh, bucket_cap_mb=0.01)
    idx, tgt = batches(1, 4)[0]
    pyparallel.reset_comm_stats()
    ddp(idx, tgt).backward()
    stats = pyparallel.comm_stats()["by_op_axis"]["all_reduce@dp"]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return stats, grad_bytes, len(ddp.buckets), mesh.dp


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_are_the_gradient_bytes(world):
    stats, grad_bytes, nbuckets, n = run(accounting_body, world)[0]
    assert stats["payload_bytes"] == grad_bytes
    assert stats["calls"] == nbuckets
    assert stats["wire_bytes"] == pytest.approx(2 * (n - 1) / n * grad_bytes, abs=nbuckets)


def mismatch_body():
    mesh = pyparallel.init()
    model = Net(n_embd=32 if dist.get_rank() == 0 else 16)
    with pytest.raises(ValueError) as info:
        pyparallel.DataParallel(model, mesh)
    return str(info.value)


def test_models_that_differ_across_ranks_are_named():
    messages = run(mismatch_body, 2)
    for msg in messages:
        assert "gpt.embed.wte.weight" in msg and "(64, 32)" in msg and "(64, 16)" in msg
        assert "rank 0" in msg and "rank 1" in msg


def reduce_dtype_body():
    mesh = pyparallel.init()
    rank, world = mesh.dp_rank, mesh.dp
    idx, tgt = batches(1, 4 * world)[0]
    local = 4
    # Reference: each rank's bf16 gradient, averaged in fp32, rounded back to bf16.
    per_rank = []
    for r in range(world):
        m = Net().to(torch.bfloat16)
        m(idx[r * local:(r + 1) * local], tgt[r * local:(r + 1) * local]).backward()
        per_rank.append({n: p.grad.float() for n, p in m.named_parameters()})
    expected = {n: (sum(g[n] for g in per_rank) / world).to(torch.bfloat16) for n in per_rank[0]}
    model = Net().to(torch.bfloat16)
    ddp = pyparallel.DataParallel(model, mesh, bucket_cap_mb=0.004, reduce_dtype=torch.float32)
    pyparallel.reset_comm_stats()
    ddp(idx[rank * local:(rank + 1) * local], tgt[rank * local:(rank + 1) * local]).backward()
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.bfloat16
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=0, msg=n)
    sent = pyparallel.comm_stats()["by_op_axis"]["all_reduce@dp"]["payload_bytes"]
    return sent == 4 * sum(p.numel() for p in model.parameters())  # reduced in fp32 on the wire


def test_bf16_model_reduces_in_fp32():
    assert run(reduce_dtype_body, 2) == [True, True]
