"""fp16 dynamic loss scaling agrees across ranks; bad ZeRO configurations fail at setup, naming the value."""

import pytest
import torch
import torch.nn as nn
from dist import run
from zero_common import ZNet, batches, reference

import pyparallel
from pyparallel import comm, zero
from pyparallel.amp import DynamicLossScaler

BATCH = 8
SGD = dict(lr=0.05, momentum=0.9)


def _step(model, opt, mesh, idx, tgt, poison=False):
    rank, local = mesh.dp_rank, BATCH // mesh.dp
    loss = model(idx[rank * local:(rank + 1) * local], tgt[rank * local:(rank + 1) * local])
    if poison:
        loss = loss * float("inf")  # this rank's gradients become inf / NaN
    loss.backward()
    opt.step()
    opt.zero_grad()


def fp16_body(ref_one_step):
    mesh = pyparallel.init()
    data = batches(3, BATCH)
    out = {}
    for stage in (1, 2, 3):
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=1000)
        model, opt = zero.setup(ZNet(), mesh, stage=stage, optimizer=torch.optim.SGD, **SGD,
                                param_dtype=torch.float16, loss_scaler=scaler)
        assert opt.scaler is scaler
        _step(model, opt, mesh, *data[0])
        after_one = model.full_state_dict()
        # The scale was divided out: one step equals one fp32 step up to fp16 rounding (an unscaled
        # update would be 1024 times larger).
        for name, ref in ref_one_step.items():
            torch.testing.assert_close(after_one[name], ref, rtol=0.0, atol=2e-3, msg=f"stage {stage}: {name}")
        state = opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"].clone()
        # Only rank 1 overflows; every rank must skip and lower the scale.
        _step(model, opt, mesh, *data[1], poison=mesh.dp_rank == 1)
        skipped = model.full_state_dict()
        for name, value in after_one.items():
            assert torch.equal(skipped[name], value), f"stage {stage}: {name} changed in a skipped step"
        assert scaler.scale == 2.0**9 and scaler.skipped_steps == 1
        assert torch.equal(opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"], state)
        _step(model, opt, mesh, *data[2])
        final = model.full_state_dict()
        assert scaler.skipped_steps == 1 and scaler.good_steps == 2
        assert all(torch.isfinite(v).all() for v in final.values())
        assert any(not torch.equal(final[n], after_one[n]) for n in final)
        out[stage] = scaler.scale
    return out


def test_fp16_overflow_on_one_rank_skips_everywhere():
    ref_one_step = reference(1, BATCH, optimizer=torch.optim.SGD, **SGD)[1]
    for scales in run(fp16_body, 2, ref_one_step):
        assert scales == {1: 2.0**9, 2: 2.0**9, 3: 2.0**9}


def _frozen_only():
    net = ZNet()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def bad_input_body():
    mesh = pyparallel.init()
    net = ZNet()
    cases = [
        (dict(stage=4), r"stage must be 1, 2 or 3, got 4"),
        (dict(stage=0), r"got 0 \(stage 0 is plain pyparallel.DataParallel\)"),
        (dict(optimizer=torch.optim.AdamW(net.parameters())), r"not an instance \(AdamW object\)"),
        (dict(optimizer=torch.optim.LBFGS), r"optimizer LBFGS is not known to be element-wise"),
        (dict(optimizer="adamw"), r"torch.optim.Optimizer subclass, got 'adamw'"),
        (dict(betas0=(0.9, 0.99)), r"optimizer arguments \['betas0', 'lr'\] do not fit AdamW"),
        (dict(bucket_cap_mb=0), r"bucket_cap_mb must be positive, got 0"),
        (dict(clip_grad_norm=-1.0), r"clip_grad_norm must be a positive number or None, got -1.0"),
        (dict(stage=1, wrap_policy=[net.gpt.embed]), r"wrap_policy only applies to stage 3 \(got stage 1\)"),
        (dict(stage=3, wrap_policy="blocks"), r"wrap_policy must be None, a callable .* got 'blocks'"),
        (dict(stage=3, wrap_policy=[nn.Linear(2, 2)]), r"wrap_policy lists a module that is not part"),
        (dict(param_dtype=torch.int8), r"param_dtype must be .* got torch.int8"),
        (dict(reduce_dtype=torch.float64), r"reduce_dtype must be .* got torch.float64"),
        (dict(loss_scaler=DynamicLossScaler()), r"loss_scaler only applies with param_dtype=torch.float16"),
        (dict(mesh="dp"), r"mesh must be a pyparallel.ParallelMesh"),
        (dict(module=_frozen_only()), r"no trainable parameters"),
        (dict(module=pyparallel.DataParallel(ZNet(), mesh)), r"not already wrapped\), got DataParallel"),
    ]
    for kw, pattern in cases:
        args = {"module": net, "mesh": mesh, "stage": 2, "optimizer": torch.optim.AdamW, "lr": 1e-3, **kw}
        with pytest.raises(ValueError, match=pattern):
            zero.setup(**args)
    with pytest.raises(ValueError, match=r"init_scale \(0\) and min_scale \(1.0\) must be positive"):
        DynamicLossScaler(init_scale=0)
    # Every failure came before the first collective: the group is still in step.
    t = torch.ones(1)
    comm.all_reduce(t, mesh.dp_group)
    return t.item()


def test_bad_configuration_fails_at_setup_naming_the_value():
    assert run(bad_input_body, 2) == [2.0, 2.0]
