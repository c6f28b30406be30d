"""ZeRO on a GPU (skipped without one; benchmarks/gpu_check.sh runs it with ``-k cuda``).

A world of one over gloo with the model on the GPU: the collectives reduce to local copies, so what runs is
the device side of every stage — flat buffers and shards on the GPU, stage 3 freeing and refilling gathered
storage through the caching allocator, autograd hooks on the device thread, the fused CUDA Adam writing the
bf16 copy. fp32 must equal one process on the GPU (default tolerance); bf16 stages 2 and 3 must agree with
each other to fp32 tolerance (the same arithmetic).
"""

import pytest
import torch
from dist import run
from zero_common import LR, WD, ZNet, batches

import pyparallel
from pyparallel import zero

STEPS, BATCH = 5, 8


def _steps(model, opt, dev):
    losses = []
    for idx, tgt in batches(STEPS, BATCH):
        loss = model(idx.to(dev), tgt.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def cuda_body():
    mesh = pyparallel.init()
    dev = torch.device("cuda")
    mesh.device = dev  # gloo world of one: every collective is a local copy; the tensors live on the GPU
    ref = ZNet().to(dev)
    ref_losses = _steps(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                                               weight_decay=WD), dev)
    for stage in (1, 2, 3):
        model, opt = zero.setup(ZNet().to(dev), mesh, stage=stage, optimizer=torch.optim.AdamW, lr=LR,
                                weight_decay=WD, clip_grad_norm=10.0)
        torch.testing.assert_close(torch.tensor(_steps(model, opt, dev)), torch.tensor(ref_losses))
        got = model.full_state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), msg=f"cuda stage {stage}: {name}")
    bf16 = {}
    for stage in (2, 3):
        model, opt = zero.setup(ZNet().to(dev), mesh, stage=stage, optimizer=torch.optim.AdamW, lr=LR,
                                weight_decay=WD, param_dtype=torch.bfloat16)
        bf16[stage] = (_steps(model, opt, dev), model.full_state_dict())
    torch.testing.assert_close(torch.tensor(bf16[3][0]), torch.tensor(bf16[2][0]))
    for name, value in bf16[2][1].items():
        torch.testing.assert_close(bf16[3][1][name], value, msg=f"cuda bf16 stage 3 vs 2: {name}")
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the CPU tests cover the same code)")
def test_zero_cuda_all_stages_world_of_one():
    assert run(cuda_body, 1) == [True]
