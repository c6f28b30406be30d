"""ZeRO-Offload's host side: OptimizerOffload against the same optimizer on the device, the copy engine, and
pyparallel.zero.setup(..., offload_optimizer=True) against the same stage without offload (2 ranks).

Here the "device" is the CPU: the copies run on the engine's worker thread, the same Python path as the
side CUDA stream on a GPU (that path is exercised on a lent GPU by the CUDA test at the end).
"""

import pytest
import torch
from dist import run
from zero_common import LR, WD, ZNet, train

import pyparallel
from pyparallel import _ops, zero
from pyparallel.optim import CPUAdam
from pyparallel.zero.offload import OptimizerOffload

N = 4099  # odd: not a multiple of any SIMD width
CPU = torch.device("cpu")


def _master(seed=0, n=N):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _grad(step, n=N, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + step)).to(dtype)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _device_reference(steps, factory=_adamw, grad_dtype=torch.float32):
    p = torch.nn.Parameter(_master())
    opt = factory([p])
    for s in range(steps):
        p.grad = _grad(s, dtype=grad_dtype).float()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_offload_equals_adamw_on_the_device(out_dtype):
    off = OptimizerOffload(_master(), _adamw, CPU)
    assert off.fused  # torch.optim.AdamW runs in the CPU Adam kernel
    out = torch.empty(N, dtype=out_dtype)
    for s in range(10):
        off.push_grad(_grad(s))
        off.step(out)
        off.wait()
        assert torch.equal(out, off.master.to(out_dtype))  # the fused copy is the rounded master, exactly
    torch.testing.assert_close(off.master, _device_reference(10))
    # The same kernel on the device gives the same bits.
    p = torch.nn.Parameter(_master())
    ref = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    for s in range(10):
        p.grad = _grad(s)
        ref.step()
    assert torch.equal(off.master, p.detach())
    assert off.optimizer.state[off.optimizer.param_groups[0]["params"][0]]["step"] == 10


def test_pieces_bf16_grads_lr_schedule_and_state_bytes():
    off = OptimizerOffload(_master(), _adamw, CPU)
    p = torch.nn.Parameter(_master())
    ref = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    out = torch.empty(N)
    for s in range(6):
        g = _grad(s, dtype=torch.bfloat16)
        for lo in range(0, N, 1000):  # pushed piecewise, as buckets finish
            off.push_grad(g[lo:lo + 1000], offset=lo)
        for o in (off, ref):
            o.param_groups[0]["lr"] = 1e-2 * 0.7 ** s
        off.step(out)
        off.wait()
        ref.step(grads=[g])
    assert torch.equal(off.master, p.detach()) and torch.equal(out, p.detach())
    sb = off.state_bytes()
    assert sb["master"] == 4 * N and sb["optimizer"] == 8 * N + 4  # m, v and the step counter
    assert sb["buffers"] == 2 * N and sb["total"] == sb["master"] + sb["optimizer"] + sb["buffers"]


@pytest.mark.parametrize("factory", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),  # not Adam: its own step
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),               # with cpu_adam=False
], ids=["sgd", "adamw-unfused"])
def test_other_optimizers_run_their_own_step(factory):
    off = OptimizerOffload(_master(), factory, CPU, cpu_adam=False)
    assert not off.fused
    out = torch.empty(N, dtype=torch.bfloat16)
    for s in range(5):
        off.push_grad(_grad(s))
        off.step(out)
        off.wait()
    assert torch.equal(off.master, _device_reference(5, factory))  # exactly torch's own update
    assert torch.equal(out, off.master.to(torch.bfloat16))


def test_delayed_update_ships_the_previous_update():
    """DPU (ZeRO-Offload section 5.2): after step k the device holds the master of k-1 updates; the host
    master itself follows the ordinary sequence, so a flush gives the synchronous result."""
    steps, warmup = 6, 2
    off = OptimizerOffload(_master(), _adamw, CPU, delayed_update=True, delayed_update_after=warmup)
    p = torch.nn.Parameter(_master())
    ref = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    history = [p.detach().clone()]
    out = torch.empty(N)
    for s in range(steps):
        off.push_grad(_grad(s))
        off.step(out)
        off.wait()
        p.grad = _grad(s)
        ref.step()
        history.append(p.detach().clone())
        expected = history[s + 1] if s < warmup else history[s]  # one update behind once DPU starts
        assert torch.equal(out, expected), f"step {s}"
    off.flush(out)
    assert torch.equal(out, history[-1]) and torch.equal(off.master, history[-1])


def test_engine_copies_by_ticket_and_reports_failures():
    if not _ops.HAS_EXT:
        pytest.skip("the copy engine is compiled")
    eng = _ops._C.OffloadCopyEngine(CPU, False)
    assert not eng.uses_cuda and not eng.pinned
    src = [torch.randn(100_000) for _ in range(4)]
    dst = [eng.alloc(100_000, torch.bfloat16, f"buffer {i}") for i in range(4)]
    tickets = [eng.copy(d, s) for d, s in zip(dst, src)]
    assert tickets == [1, 2, 3, 4]
    eng.wait(tickets[-1])
    assert all(eng.done(t) for t in tickets)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(torch.bfloat16))
    bad = eng.copy(torch.zeros(1).expand(4), torch.ones(4, dtype=torch.float64))  # overlapping destination
    with pytest.raises(RuntimeError, match=f"copy {bad} failed"):
        eng.wait(bad)
    with pytest.raises(RuntimeError, match="unknown ticket 99"):
        eng.wait(99)


def test_out_of_memory_names_the_bytes():
    if _ops.HAS_EXT:
        eng = _ops._C.OffloadCopyEngine(CPU, False)
        with pytest.raises(MemoryError, match=r"could not allocate 4503599627370496 bytes \(4194304.00 GiB\)"):
            eng.alloc(2**50, torch.float32, "a test buffer")
    with pytest.raises(MemoryError, match=r"needs about 16000000000000000 bytes"):
        OptimizerOffload._check_host_memory(10**15)


def test_bad_calls_fail_clearly():
    with pytest.raises(ValueError, match="1-D fp32"):
        OptimizerOffload(torch.zeros(3, 3), _adamw, CPU)
    off = OptimizerOffload(_master(), _adamw, CPU)
    with pytest.raises(ValueError, match=f"push_grad delivered 0 of the shard's {N}"):
        off.step(torch.empty(N))
    with pytest.raises(ValueError, match="overflow the shard"):
        off.push_grad(torch.zeros(10), offset=N - 5)
    off.push_grad(_grad(0))
    with pytest.raises(ValueError, match=f"contiguous fp32/bf16/fp16 tensor of {N} elements"):
        off.step(torch.empty(N + 1))


# ---------------------------------------------------------------- ZeRO integration (2 ranks)

STEPS, BATCH, MICRO = 10, 8, 2


def _zero_setup(stage, mesh, offload, **kw):
    net = ZNet()
    extra = {"wrap_policy": [net.gpt.embed, *net.gpt.blocks, net.gpt.head]} if stage == 3 else {}
    return zero.setup(net, mesh, stage=stage, optimizer=torch.optim.AdamW, lr=LR, weight_decay=WD,
                      offload_optimizer=offload, **extra, **kw)


def zero_offload_body(stage):
    """fp32 with clipping, then bf16 compute (the offload ships the fused bf16 copy back)."""
    mesh = pyparallel.init()
    for kw in (dict(clip_grad_norm=0.5), dict(param_dtype=torch.bfloat16)):
        results = {}
        for offload in (False, True):
            model, opt = _zero_setup(stage, mesh, offload, **kw)
            losses = train(model, opt, mesh, STEPS, BATCH, MICRO)
            results[offload] = (losses, model.full_state_dict())
            if offload:
                assert isinstance(model.engine.updater, OptimizerOffload) and model.engine.updater.fused
        (l0, p0), (l1, p1) = results[False], results[True]
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l0), msg=f"stage {stage} {kw}: losses")
        for name, ref in p0.items():
            torch.testing.assert_close(p1[name], ref, msg=f"stage {stage} {kw}: {name} after {STEPS} steps")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_offload_equals_zero_without_offload(stage):
    assert all(run(zero_offload_body, 2, stage))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the CPU path above is the same code)")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_offload_pins_and_matches(out_dtype):
    dev = torch.device("cuda")
    off = OptimizerOffload(_master().to(dev), _adamw, dev)
    assert off.pinned and off.master.is_pinned() and off.master.device.type == "cpu"
    out = torch.empty(N, device=dev, dtype=out_dtype)
    for s in range(10):
        off.push_grad(_grad(s).to(dev))
        off.step(out)
        off.wait()
        assert torch.equal(out.cpu(), off.master.to(out_dtype))
    torch.testing.assert_close(off.master, _device_reference(10))
