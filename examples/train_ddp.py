"""Train the built-in GPT with pyparallel.DataParallel on synthetic tokens.

The same script runs three ways:
    python examples/train_ddp.py --nprocs 2                  # spawns 2 local processes itself
    torchrun --nproc-per-node 2 examples/train_ddp.py        # one node
    torchrun --nnodes 2 --node-rank K --rdzv-backend c10d --rdzv-endpoint HOST:PORT --nproc-per-node 1 \
        examples/train_ddp.py                                # several nodes
"""

import argparse
import json
import os

import torch

import pyparallel
from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch


def train(preset: str, steps: int, batch: int, seq: int, lr: float) -> dict:
    mesh = pyparallel.init()  # every rank is a data-parallel replica
    cfg = gpt_config(preset)
    model = GPT(cfg, seed=0).to(mesh.device)
    ddp = pyparallel.DataParallel(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    local = batch // mesh.dp
    losses = []
    for step in range(steps):
        idx, tgt = synthetic_batch(cfg, batch, seq, seed=step)
        rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
        loss = ddp(idx[rows].to(mesh.device), tgt[rows].to(mesh.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        pyparallel.comm.all_reduce(mean, mesh.dp_group, op="avg")
        losses.append(mean.item())
        if mesh.rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    stats = pyparallel.comm_stats()["total"]
    return {"losses": losses, "world_size": mesh.world_size, "bytes_sent": stats["wire_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over the ranks)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--nprocs", type=int, default=2, help="processes to spawn when not under torchrun")
    args = parser.parse_args()
    kwargs = (args.preset, args.steps, args.batch, args.seq, args.lr)
    if "RANK" in os.environ:  # under torchrun
        result = train(*kwargs)
        if int(os.environ["RANK"]) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        pyparallel.shutdown()  # before the interpreter exits: see pyparallel.shutdown
    else:
        result = pyparallel.launch(train, args.nprocs, kwargs)[0]
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
