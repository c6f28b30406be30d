"""ZeRO stages 1-3 equal one process on the whole batch.

One body per world size trains all three stages for 10 steps with gradient accumulation (2 micro-batches,
the first under ``no_sync``), global-norm clipping that really clips, a tied embedding / LM head, an
odd-sized parameter, a one-element parameter whose own flat group is mostly padding, and a frozen
parameter; losses and every parameter must match the single-process reference at default fp32 tolerance.

bf16 (compute in bf16, fp32 master weights, fp32 gradient reductions) is compared with the same fp32
reference at a stated tolerance, using SGD with momentum so that a gradient's error maps linearly onto the
weights (Adam's per-element normalisation turns even the rounding of a near-zero gradient into an update
of up to one learning rate, which says nothing about the implementation). Gradients computed from bf16
weights and activations carry a relative rounding error of about 2^-8; over 10 steps at lr 0.05 that
moves weights by at most 2e-3 (observed: 7e-4 max, 1.4e-5 mean) and the loss by 1e-3 relative (observed
7e-5). Stages 2 and 3 run the same arithmetic (each micro-batch reduced in fp32 and accumulated in fp32)
and must agree with each other to fp32 tolerance; stage 1 accumulates micro-batches locally in bf16, so it
only meets the reference tolerance.
"""

import pytest
import torch
import torch.nn as nn
from dist import run
from zero_common import LR, WD, ZNet, eval_loss, reference, train

import pyparallel
from pyparallel import _ops, zero
from pyparallel.optim import CPUAdam

STEPS = 10
BATCH = 8
MICRO = 2
CLIP = 0.5


def _setup(stage, mesh, **kw):
    net = ZNet()
    if stage == 1:
        extra = {"bucket_cap_mb": 1e-9}  # every parameter in a bucket of its own (the gain: 1 element)
    elif stage == 2:
        extra = {"bucket_cap_mb": 0.004}  # ~4 KB buckets: several parameters each
    else:
        g = net.gpt
        extra = {"wrap_policy": [g.embed, *g.blocks, g.head, net.gain]}  # the gain is a unit by itself
    opt_kw = {"optimizer": torch.optim.AdamW, "lr": LR, "weight_decay": WD}
    opt_kw.update(kw)
    return zero.setup(net, mesh, stage=stage, **extra, **opt_kw)


def fp32_parity_body(ref):
    mesh = pyparallel.init()
    ref_losses, ref_params, ref_norms, ref_eval = ref
    out = {}
    for stage in (1, 2, 3):
        model, opt = _setup(stage, mesh, clip_grad_norm=CLIP)
        losses = train(model, opt, mesh, STEPS, BATCH, MICRO)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=f"stage {stage} losses")
        params = model.full_state_dict()
        _assert_padding_is_zero(model)
        assert model.engine.updater.fused == _ops.has_kernel("adam_step", mesh.device)  # AdamW: fused kernel
        assert set(params) == set(ref_params)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, msg=f"stage {stage}: {name} after {STEPS} steps")
        assert opt.last_grad_norm == pytest.approx(ref_norms[-1], rel=1e-4)
        assert eval_loss(model, mesh, BATCH) == pytest.approx(ref_eval, rel=1e-5)  # no-grad forward too
        out[stage] = len(model.engine.layouts)
    return out


def _assert_padding_is_zero(model):
    """The padded tail of every flat group holds zero weights on the rank that owns it: nothing leaked."""
    eng = model.engine
    for g, lay in enumerate(eng.space.layouts):
        a, b = lay.shard_range(eng.space.rank)
        lo = max(a, lay.numel)
        if lo < b:
            assert torch.all(eng.master_slice(g)[lo - a:] == 0), f"group {g}: padding is not zero"


@pytest.mark.parametrize("world", [2, 4])
def test_fp32_parity_all_stages(world):
    ref = reference(STEPS, BATCH, clip=CLIP)  # once, here, rather than on every rank
    assert max(ref[2]) > CLIP  # clipping really happens
    groups = run(fp32_parity_body, world, ref)[0]
    assert groups[1] > 20  # stage 1 really used one bucket per parameter
    assert groups[3] == 6  # root (tied wte + odd bias), embed, 2 blocks, head, gain


SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01)


def bf16_parity_body(ref):
    mesh = pyparallel.init()
    ref_losses, ref_params, _, _ = ref
    results = {}
    for stage in (1, 2, 3):
        model, opt = _setup(stage, mesh, param_dtype=torch.bfloat16, optimizer=torch.optim.SGD, **SGD)
        assert model.module.gpt.head.ln_f.bias is None or model.module.gpt.head.ln_f.bias.dtype == torch.bfloat16
        losses = train(model, opt, mesh, STEPS, BATCH, MICRO)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3, atol=0.0)
        params = model.full_state_dict()
        for name, ref in ref_params.items():
            if name == "frozen_mix":  # never trained: stored in bf16, so equal to the reference up to rounding
                torch.testing.assert_close(params[name], ref, rtol=2**-8, atol=0.0)
                continue
            torch.testing.assert_close(params[name], ref, rtol=0.0, atol=2e-3, msg=f"bf16 stage {stage}: {name}")
        errs = torch.cat([(params[n] - r).abs().flatten() for n, r in ref_params.items()])
        assert errs.mean() < 5e-5, f"bf16 stage {stage}: mean error {errs.mean():.2e}"
        results[stage] = (losses, params)
    torch.testing.assert_close(torch.tensor(results[3][0]), torch.tensor(results[2][0]))
    for name, value in results[2][1].items():
        torch.testing.assert_close(results[3][1][name], value, msg=f"bf16 stage 3 vs stage 2: {name}")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_parity_all_stages(world):
    run(bf16_parity_body, world, reference(STEPS, BATCH, optimizer=torch.optim.SGD, **SGD))


class Stack(nn.Module):
    """A model that is not the GPT: a residual MLP stack in an nn.ModuleList (the default stage-3 policy makes
    each block a unit; the input and output layers stay in the root unit)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(13, 24)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(24, 5)
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.out(h), y)


def _stack_data(steps, batch=16):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 13, generator=gen), torch.randint(0, 5, (batch,), generator=gen))
            for _ in range(steps)]


OPTIMIZERS = {
    "adam+schedule": (torch.optim.Adam, {"lr": 3e-3, "betas": (0.8, 0.95)}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    "cpu-adamw": (CPUAdam, {"lr": 3e-3, "weight_decay": 0.1}),  # the compiled Adam (pyparallel.optim)
}


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def stack_reference():
    out = {}
    for name, (cls, kw) in OPTIMIZERS.items():
        model = Stack()
        opt = cls(model.parameters(), **kw)
        sched = _schedule(opt) if "schedule" in name else None
        for x, y in _stack_data(STEPS):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if sched:
                sched.step()
        out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def stack_body(ref):
    mesh = pyparallel.init()
    rank, local = mesh.dp_rank, 16 // mesh.dp
    units = {}
    for stage in (1, 2, 3):
        for name, (cls, kw) in OPTIMIZERS.items():
            extra = {}
            if stage == 3 and "sgd" in name:  # every Linear a unit, nested inside the Sequential blocks
                extra["wrap_policy"] = lambda qualname, m: isinstance(m, nn.Linear)
            model, opt = zero.setup(Stack(), mesh, stage=stage, optimizer=cls, **kw, bucket_cap_mb=1e-3, **extra)
            sched = _schedule(opt) if "schedule" in name else None
            for x, y in _stack_data(STEPS):
                x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
                h = local // 2
                if name == "adam+schedule":  # two forwards (two graphs), one backward
                    ((model(x[:h], y[:h]) + model(x[h:], y[h:])) / 2).backward()
                elif name == "sgd-nesterov":  # two synchronised backwards (no no_sync) before the step
                    (model(x[:h], y[:h]) / 2).backward()
                    (model(x[h:], y[h:]) / 2).backward()
                else:
                    model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if sched:
                    sched.step()
            params = model.full_state_dict()
            for pname, value in ref[name].items():
                torch.testing.assert_close(params[pname], value, msg=f"stage {stage}, {name}: {pname}")
            if stage == 3:
                units[name] = [u.spec.name for u in model.engine.gatherer.units]
    return units


def test_other_model_optimizers_schedules_and_wrap_policies():
    units = run(stack_body, 2, stack_reference())[0]
    assert units["adam+schedule"] == ["", "blocks.0", "blocks.1", "blocks.2"]  # root: inp and out
    assert units["sgd-nesterov"] == ["inp", "blocks.0.0", "blocks.1.0", "blocks.2.0", "out"]


def _groups(named: dict) -> list[dict]:
    """Decay on matrices, none on vectors (biases, norms, the gain), a third of the learning rate on the
    tied embedding: three user groups whose parameters alternate along the flat groups."""
    emb = [p for n, p in named.items() if "wte" in n]
    return [{"params": [p for n, p in named.items() if p.dim() >= 2 and "wte" not in n]},
            {"params": [p for n, p in named.items() if p.dim() < 2], "weight_decay": 0.0},
            {"params": emb, "lr": LR / 3}]


def _trainable(net) -> dict:
    return {n: p for n, p in net.named_parameters() if p.requires_grad}


def _grouped_adamw(params, **kw):
    """The reference's AdamW over the same groups (``reference`` hands the trainable parameters in order)."""
    return torch.optim.AdamW(_groups(dict(zip(_trainable(ZNet()), params))), **kw)


def grouped_body(ref):
    mesh = pyparallel.init()
    ref_losses, ref_params, _, _ = ref
    interleaved = {}
    for stage, offload in ((1, False), (2, False), (3, False), (2, True)):
        net = ZNet()
        model, opt = _setup_grouped(net, mesh, stage, offload)
        assert model.engine.updater.fused == _ops.has_kernel("adam_step", torch.device("cpu"))
        losses = train(model, opt, mesh, STEPS, BATCH, MICRO)
        what = f"stage {stage}{' offload' if offload else ''}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=f"{what} losses")
        params = model.full_state_dict()
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, msg=f"{what}: {name} after {STEPS} steps")
        kinds = [r.k for r in model.engine.runs]
        interleaved[what] = kinds != sorted(kinds)
    return interleaved


def _setup_grouped(net, mesh, stage, offload):
    g = net.gpt
    extra = ({"wrap_policy": [g.embed, *g.blocks, g.head, net.gain]} if stage == 3
             else {"bucket_cap_mb": 1e-9 if stage == 1 else 0.004})
    return zero.setup(net, mesh, stage=stage, optimizer=torch.optim.AdamW, lr=LR, weight_decay=WD,
                      param_groups=_groups(_trainable(net)), offload_optimizer=offload, **extra)


def test_fused_adam_pairs_each_run_with_its_own_gradient_under_param_groups():
    """fp32 masters take the fused Adam kernel, which once paired the runs' gradients (in the order of the
    flat groups) with the optimizer's parameters in param_groups order: with several user groups whose
    parameters alternate, each run was stepped with another run's gradient (silently, where the sizes
    matched). Each stage, and offload, against torch's AdamW over the same groups in one process."""
    ref = reference(STEPS, BATCH, optimizer=_grouped_adamw, lr=LR, weight_decay=WD)
    interleaved = run(grouped_body, 2, ref)[0]
    assert all(interleaved.values()), interleaved  # the runs' order is not param_groups' order
