"""One rank of the multi-host tests (run by torchrun): a few AdamW steps of the tiny GPT under DDP, ZeRO-3
and dp x tp, one after the other in the same processes. Rank 0 prints ``RESULT {...}`` with each
strategy's global-mean losses and the host of every rank."""

import json
import os
import socket
import sys

import torch

import pyparallel
from pyparallel import comm, zero
from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch

STEPS, BATCH, SEQ, LR = 3, 8, 16, 3e-3


def _mean(loss, group) -> float:
    value = loss.detach().clone()
    comm.all_reduce(value, group, op="avg")
    return value.item()


def ddp(mesh, cfg):
    model = GPT(cfg, seed=0)
    wrapped = pyparallel.DataParallel(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return wrapped, opt


def zero3(mesh, cfg):
    return zero.setup(GPT(cfg, seed=0), mesh, stage=3, lr=LR)


def run_dp(mesh, cfg, build) -> list[float]:
    model, opt = build(mesh, cfg)
    local = BATCH // mesh.dp
    losses = []
    for step in range(STEPS):
        idx, tgt = synthetic_batch(cfg, BATCH, SEQ, seed=step)
        rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
        loss = model(idx[rows], tgt[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss, mesh.dp_group))
    return losses


def run_parallelize(mesh, cfg) -> list[float]:
    pm = pyparallel.parallelize(GPT(cfg, seed=0), mesh, zero_stage=1, optimizer=torch.optim.AdamW, lr=LR)
    rows = pm.batch_slice(BATCH)
    losses = []
    for step in range(STEPS):
        idx, tgt = synthetic_batch(cfg, BATCH, SEQ, seed=step)
        losses.append(float(pm.step(idx[rows], tgt[rows])))
    return losses


def main() -> None:
    cfg = gpt_config("tiny")
    which = sys.argv[1].split(",")
    out = {}
    if "ddp" in which or "zero3" in which:
        mesh = pyparallel.init()
        if "ddp" in which:
            out["ddp"] = run_dp(mesh, cfg, ddp)
        if "zero3" in which:
            out["zero3"] = run_dp(mesh, cfg, zero3)
        hosts = comm.all_gather_object(socket.gethostname(), mesh.world_group)
    if "dp2xtp2" in which:
        mesh = pyparallel.init(dp=2, tp=2)
        out["dp2xtp2"] = run_parallelize(mesh, cfg)
        hosts = comm.all_gather_object(socket.gethostname(), mesh.world_group)
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps({"losses": out, "hosts": hosts}), flush=True)
    pyparallel.shutdown()


if __name__ == "__main__":
    main()
