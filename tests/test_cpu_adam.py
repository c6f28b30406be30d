"""CPUAdam / the adam_step kernel against torch.optim.Adam / AdamW and against the plain-torch reference.

Sizes are odd (not multiples of any SIMD width) so every path's scalar tail runs, and one optimizer holds
all of them so the multi-tensor split across threads crosses tensor boundaries. Every SIMD level the CPU
has must give bit-identical results (the kernel's rounding order is fixed: see csrc/include/pyparallel/
adam_kernel.h). Against torch the match is at fp32 tolerance, not bitwise: torch's CPU sqrt is not
correctly rounded (about 1 ulp off on a sixth of the inputs), ours is.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

from pyparallel import _ops
from pyparallel.optim import CPUAdam, FusedAdam, set_simd_level, simd_level, supported_simd_levels
from pyparallel.optim.cpu_adam import fused_step

SIZES = (1, 7, 1031, 65537 + 3)
LEVELS = supported_simd_levels()
CONFIGS = {
    "adamw": dict(weight_decay=0.1),
    "adam_l2": dict(weight_decay=0.1, adamw=False),
    "maximize": dict(weight_decay=0.05, maximize=True),
    "amsgrad": dict(weight_decay=0.1, amsgrad=True),
    "plain": dict(weight_decay=0.0),  # explicit: torch.optim.AdamW defaults to 0.01
}

pytestmark = pytest.mark.skipif(not _ops.HAS_EXT, reason="needs the compiled extension (the kernel under test)")


def _params(seed=0, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _grads(step, params, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=gen) * (1 + step % 3)).to(dtype) for p in params]


def _torch_opt(params, cfg, lr):
    kw = dict(cfg)
    adamw = kw.pop("adamw", True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    return cls(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, **kw)


@pytest.fixture
def level_guard():
    previous = simd_level()
    yield
    set_simd_level(previous)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_torch_over_100_steps(name):
    cfg, lr = CONFIGS[name], 1e-2
    ours, theirs = _params(), _params()
    opt, ref = CPUAdam(ours, lr=lr, **cfg), _torch_opt(theirs, cfg, lr)
    for step in range(100):
        for p, q, g in zip(ours, theirs, _grads(step, ours)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), msg=f"{name}: params after 100 steps")
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if cfg.get("amsgrad") else ()):
            torch.testing.assert_close(opt.state[p][key], ref.state[q][key], msg=f"{name}: {key}")
        assert float(opt.state[p]["step"]) == 100.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowp_copy_is_the_rounded_fp32_result(dtype):
    params = _params(seed=3)
    opt = CPUAdam(params, lr=1e-2, weight_decay=0.1)
    outs = [torch.empty(p.shape, dtype=dtype) for p in params]
    for step in range(10):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step(lowp_out=outs)
        for p, o in zip(params, outs):
            assert torch.equal(o, p.detach().to(dtype)), f"step {step}: {dtype} copy differs from .to({dtype})"


def _run_all_paths(steps=8):
    """Every kernel variant in one run: all configs, fp32/bf16/fp16 grads, with and without a bf16 copy.
    The sizes still add up to more than one thread's grain (2**15), so the split across threads runs."""
    results = []
    for name, cfg in CONFIGS.items():
        for gdtype, lowp in [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]:
            params = _params(seed=5, sizes=(1, 7, 1031, 40000 + 3))
            opt = CPUAdam(params, lr=1e-2, **cfg)
            outs = [torch.empty(p.shape, dtype=lowp) for p in params] if lowp else None
            for step in range(steps):
                opt.step(grads=_grads(step, params, gdtype), lowp_out=outs)
            results.append((name, gdtype, [p.detach().clone() for p in params], outs,
                            [opt.state[p]["exp_avg_sq"].clone() for p in params]))
    return results


def test_every_simd_level_gives_identical_results(level_guard):
    assert simd_level() in LEVELS and "scalar" in LEVELS
    per_level = {}
    for level in LEVELS:
        set_simd_level(level)
        assert simd_level() == level
        per_level[level] = _run_all_paths()
    base = per_level[LEVELS[-1]]  # scalar
    for level, res in per_level.items():
        for (name, gdtype, ps, outs, vs), (_, _, ps0, outs0, vs0) in zip(res, base):
            for a, b in zip(ps + vs + (outs or []), ps0 + vs0 + (outs0 or [])):
                assert torch.equal(a, b), f"{level} differs from scalar ({name}, {gdtype} grads)"


_ENV_SCRIPT = """
import torch
from pyparallel.optim import CPUAdam, simd_level
p = torch.nn.Parameter(torch.linspace(-2, 2, 1031))
opt = CPUAdam([p], lr=1e-2, weight_decay=0.1)
for s in range(5):
    p.grad = torch.sin(torch.arange(1031.0) * (s + 1))
    opt.step()
print(simd_level(), p.detach().double().sum().item(), p.detach()[::97].tolist())
"""


def test_env_var_forces_the_level(level_guard):
    """PYPARALLEL_SIMD=scalar in a fresh process gives the bits the widest level gives here (the other
    levels are covered in-process by set_simd_level above; each subprocess costs a torch import)."""
    env = {**os.environ, "PYPARALLEL_SIMD": "scalar"}
    done = subprocess.run([sys.executable, "-c", _ENV_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reported, rest = done.stdout.split(" ", 1)
    assert reported == "scalar"
    set_simd_level(LEVELS[0])
    scope = {}
    exec(compile(_ENV_SCRIPT.replace("print(", "result = ("), "<env>", "exec"), scope)
    assert scope["result"][0] == LEVELS[0] and f"{scope['result'][1]} {scope['result'][2]}\n" == rest
    env = {**os.environ, "PYPARALLEL_SIMD": "avx9000"}
    bad = subprocess.run([sys.executable, "-c", _ENV_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "PYPARALLEL_SIMD='avx9000' is not a SIMD level" in bad.stderr


def test_set_simd_level_rejects_unknown_levels(level_guard):
    with pytest.raises(ValueError, match="not a SIMD level"):
        set_simd_level("sse9")
    if "avx512" not in LEVELS:
        with pytest.raises(ValueError, match="supports only"):
            set_simd_level("avx512")


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_kernel_matches_reference_on_random_inputs(gdtype, amsgrad):
    gen = torch.Generator().manual_seed(11)
    sizes = (3, 0, 17, 4099, 33 * 1024 + 5)  # an empty tensor too
    for trial in range(4):
        def rnd(scale=1.0, positive=False):
            ts = [torch.randn(n, generator=gen) * scale for n in sizes]
            return [t.abs() for t in ts] if positive else ts

        p, m, v = rnd(), rnd(0.1), rnd(0.01, positive=True)
        vmax = [t + 0.01 * torch.rand(t.shape, generator=gen) for t in v]
        g = [t.to(gdtype) for t in rnd(2.0)]
        lowp = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        hyper = dict(step=1 + 7 * trial, lr=10 ** -(1 + trial % 3), beta1=[0.9, 0.8, 0.6, 0.95][trial],
                     beta2=[0.999, 0.99, 0.95, 0.9999][trial], eps=[1e-8, 1e-6, 1e-10, 1e-8][trial],
                     weight_decay=[0.0, 0.1, 0.01, 0.3][trial], adamw=trial % 2 == 0, maximize=trial == 1,
                     amsgrad=amsgrad)
        ref = [[t.clone() for t in ts] for ts in (p, m, v, vmax)]
        _ops.adam_step(p, g, m, v, vmax if amsgrad else None, lowp, **hyper)
        _ops.adam_step_reference(ref[0], g, ref[1], ref[2], ref[3] if amsgrad else [], [], *hyper.values())
        for name, got, want in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), (p, m, v, vmax), ref):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, msg=f"trial {trial}: {name}")
        for a, o in zip(p, lowp):
            assert torch.equal(o, a.to(torch.bfloat16))


def test_params_without_grads_keep_their_own_step_counts():
    ours, theirs = _params(seed=2, sizes=(5, 300, 70)), _params(seed=2, sizes=(5, 300, 70))
    opt, ref = CPUAdam(ours, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for step in range(12):
        for i, (p, q, g) in enumerate(zip(ours, theirs, _grads(step, ours))):
            has = not (i == 1 and step % 3 == 0)  # the middle param skips every third step
            p.grad, q.grad = (g, g.clone()) if has else (None, None)
        opt.step()
        ref.step()
    assert float(opt.state[ours[1]]["step"]) == 8.0
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach())


def test_state_dict_interchanges_with_torch_adamw_and_lr_changes_apply():
    ours, theirs = _params(seed=4), _params(seed=4)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for step in range(5):
        for q, g in zip(theirs, _grads(step, theirs)):
            q.grad = g
        ref.step()
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            p.copy_(q)
    opt = CPUAdam(ours, lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch shares the tensors otherwise
    for step in range(5, 10):
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 1e-2 * (0.8 ** step)  # what an LR scheduler does
        for p, q, g in zip(ours, theirs, _grads(step, ours)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach())
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])


def test_fused_step_runs_a_torch_adam_instance():
    a, b = _params(seed=6), _params(seed=6)
    torch_opt = torch.optim.Adam(a, lr=1e-3, weight_decay=0.01)  # L2 style
    ref = torch.optim.Adam(b, lr=1e-3, weight_decay=0.01)
    for step in range(20):
        for p, q, g in zip(a, b, _grads(step, a)):
            p.grad, q.grad = g, g.clone()
        fused_step(torch_opt)
        ref.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach())


def test_fused_step_pairs_explicit_gradients_by_the_params_given():
    """Gradients given in the caller's own order (``params=``) reach their own parameters whatever the
    param_groups order (ZeRO's runs are grouped by user group inside the optimizer)."""
    a, b = _params(seed=8), _params(seed=8)
    order = [a[2], a[0], a[1]]  # not the groups' order below
    opt = torch.optim.AdamW([{"params": [a[0], a[2]], "lr": 1e-2}, {"params": [a[1]], "lr": 1e-3}])
    ref = torch.optim.AdamW([{"params": [b[0], b[2]], "lr": 1e-2}, {"params": [b[1]], "lr": 1e-3}])
    for step in range(5):
        grads = _grads(step, a)
        for q, g in zip(b, grads):
            q.grad = g.clone()
        fused_step(opt, grads=[grads[2], grads[0], grads[1]], params=order)
        ref.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach())
    with pytest.raises(ValueError, match="each of the optimizer's 3 parameters once, got 2"):
        fused_step(opt, grads=grads[:2], params=order[:2])
    with pytest.raises(ValueError, match="not the same set"):
        fused_step(opt, grads=grads, params=[a[0], a[0], a[1]])


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="Invalid betas"):
        CPUAdam(_params(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdam([torch.nn.Parameter(torch.randn(4, 6).t())])
    with pytest.raises(ValueError, match="fp32"):
        CPUAdam([torch.nn.Parameter(torch.randn(8, dtype=torch.float64))])
    p = torch.randn(10)
    with pytest.raises(RuntimeError, match="adam_step: grads\\[0\\] has 9 elements but params\\[0\\] has 10"):
        _ops.adam_step([p], [torch.randn(9)], [torch.zeros(10)], [torch.zeros(10)], step=1, lr=1e-3, beta1=0.9,
                       beta2=0.999, eps=1e-8)
    with pytest.raises(ValueError, match="step counts from 1"):
        _ops.adam_step([p], [p], [p], [p], step=0, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (compile/link is checked by the CUDA build)")
@pytest.mark.parametrize("name", ["adamw", "adam_l2", "amsgrad", "maximize"])
def test_cuda_fused_adam_matches_torch_adamw_and_the_cpu_kernel(name):
    cfg, dev = CONFIGS[name], torch.device("cuda")
    ours = [torch.nn.Parameter(p.detach().to(dev)) for p in _params()]
    theirs = [torch.nn.Parameter(p.detach().to(dev)) for p in _params()]
    host = _params()
    opt, ref, cpu = FusedAdam(ours, lr=1e-2, **cfg), _torch_opt(theirs, cfg, 1e-2), CPUAdam(host, lr=1e-2, **cfg)
    for step in range(50):
        gs = _grads(step, host)
        for p, q, h, g in zip(ours, theirs, host, gs):
            p.grad, q.grad, h.grad = g.to(dev), g.to(dev), g
        opt.step()
        ref.step()
        cpu.step()
    for p, q, h in zip(ours, theirs, host):
        torch.testing.assert_close(p.detach(), q.detach(), msg=f"{name}: CUDA kernel vs torch")
        assert torch.equal(p.detach().cpu(), h.detach()), f"{name}: CUDA kernel vs CPU kernel (same rounding)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_bf16_params_with_fp32_state_match_the_reference():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(9)
    sizes = (5, 4099, 70001)
    p = [torch.randn(n, generator=gen).to(dev, torch.bfloat16) for n in sizes]
    g = [torch.randn(n, generator=gen).to(dev, torch.bfloat16) for n in sizes]
    m = [torch.randn(n, generator=gen).to(dev) * 0.1 for n in sizes]
    v = [torch.rand(n, generator=gen).to(dev) * 0.01 for n in sizes]
    out = [torch.empty(n, device=dev, dtype=torch.float16) for n in sizes]
    ref = [[t.clone() for t in ts] for ts in (p, m, v)]
    hyper = dict(step=4, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True,
                 maximize=False, amsgrad=False)
    _ops.adam_step(p, g, m, v, None, out, **hyper)
    _ops.adam_step_reference(ref[0], g, ref[1], ref[2], [], [], *hyper.values())
    for a, b in zip(p + m + v, ref[0] + ref[1] + ref[2]):
        torch.testing.assert_close(a, b)
