"""A ZeRO checkpoint loads into any other layout and training resumes exactly.

Stage 2 on 2 ranks trains 5 steps and saves (master weights and Adam state as flat-range pieces); a fresh
stage-3 model (different flat groups) and a fresh single-process model with torch.optim.AdamW each load it
and train steps 6-10; both must end where an uninterrupted run ends (default fp32 tolerance). The reverse
direction (a single-process checkpoint into ZeRO) is covered by loading the single-process save into
stage 1.
"""

import torch
from dist import run
from zero_common import LR, WD, ZNet, batches

import pyparallel
from pyparallel import checkpoint, zero

BATCH = 8


def _zero_steps(model, opt, mesh, steps):
    rank, local = mesh.dp_rank, BATCH // mesh.dp
    for idx, tgt in steps:
        model(idx[rank * local:(rank + 1) * local], tgt[rank * local:(rank + 1) * local]).backward()
        opt.step()
        opt.zero_grad()


def _plain_steps(model, opt, steps):
    for idx, tgt in steps:
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()


def _setup(stage, mesh):
    return zero.setup(ZNet(), mesh, stage=stage, optimizer=torch.optim.AdamW, lr=LR, weight_decay=WD)


def checkpoint_body(root):
    mesh = pyparallel.init()
    data = batches(10, BATCH)
    model, opt = _setup(2, mesh)
    _zero_steps(model, opt, mesh, data)
    expected = model.full_state_dict()

    model, opt = _setup(2, mesh)
    _zero_steps(model, opt, mesh, data[:5])
    checkpoint.save(f"{root}/zero2", model, opt, step=5)

    resumed, ropt = _setup(3, mesh)  # another stage: other flat groups, other shards
    info = checkpoint.load(f"{root}/zero2", resumed, ropt)
    assert info["step"] == 5
    _zero_steps(resumed, ropt, mesh, data[5:])
    got = resumed.full_state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=f"stage 2 -> stage 3 resume: {name}")

    plain = ZNet()
    popt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    checkpoint.load(f"{root}/zero2", plain, popt)
    assert int(popt.state[plain.gpt.embed.wte.weight]["step"]) == 5
    _plain_steps(plain, popt, data[5:])
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], msg=f"stage 2 -> one process: {name}")

    # One process -> stage 1: the single-process checkpoint of step 5 resumes under ZeRO too.
    single = ZNet()
    sopt = torch.optim.AdamW([p for p in single.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    _plain_steps(single, sopt, data[:5])
    checkpoint.save(f"{root}/single", single, sopt, step=5, mesh=mesh)  # replicated: rank 0 writes
    z1, z1opt = _setup(1, mesh)
    checkpoint.load(f"{root}/single", z1, z1opt)
    _zero_steps(z1, z1opt, mesh, data[5:])
    got = z1.full_state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=f"one process -> stage 1: {name}")
    return True


def test_zero_checkpoint_resumes_in_any_layout(tmp_path):
    assert all(run(checkpoint_body, 2, str(tmp_path)))
