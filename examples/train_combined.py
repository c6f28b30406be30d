"""Train the built-in GPT with data, tensor and pipeline parallelism at once (and ZeRO, bf16), save a
checkpoint, and load it back in a single process.

    python examples/train_combined.py                               # dp=2 x tp=2 here (4 local processes)
    python examples/train_combined.py --dp 1 --tp 2 --pp 2 --zero 1
    torchrun --nproc-per-node 8 examples/train_combined.py --dp 2 --tp 2 --pp 2

The whole parallel setup is the ``pyparallel.parallelize`` call; the rest is an ordinary training loop.
For a command-line trainer with progress bar, resume and restarts, see ``pyparallel train``.
"""

import argparse
import json
import os

import torch

import pyparallel
from pyparallel import checkpoint, data
from pyparallel.models.gpt import GPT, gpt_config


def train(args) -> dict:
    mesh = pyparallel.init(dp=args.dp, tp=args.tp, pp=args.pp)
    model = GPT(gpt_config("tiny", vocab_size=data.VOCAB_SIZE), seed=0)  # the same on every rank
    model = pyparallel.parallelize(
        model, mesh, zero_stage=args.zero, param_dtype=torch.bfloat16 if args.bf16 else None,
        num_microbatches=args.micro_batches or mesh.pp, schedule="1f1b",
        optimizer=torch.optim.AdamW, lr=3e-3, weight_decay=0.1, clip_grad_norm=1.0)
    tokens = data.encode(data.load_text())
    rows = model.batch_slice(args.batch)  # this DP replica's rows of each global batch
    losses = []
    for step in range(args.steps):
        idx, targets = data.batch(tokens, step, args.batch, args.seq)
        losses.append(model.step(idx[rows], targets[rows]))  # the global mean loss, on every rank
        if mesh.rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    checkpoint.save(args.out, model, model.optimizer, step=args.steps)
    return {"losses": losses, "layout": {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", default="checkpoints/combined")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        result = train(args)
        pyparallel.shutdown()  # before the interpreter exits: see pyparallel.shutdown
        if int(os.environ["RANK"]) != 0:
            return
    else:
        result = pyparallel.launch(train, args.dp * args.tp * args.pp, (args,))[0]
    # The checkpoint is layout-independent: here it goes into the plain, unparallelised model.
    plain = GPT(gpt_config("tiny", vocab_size=data.VOCAB_SIZE), seed=1)
    meta = checkpoint.load(args.out, plain)
    idx, targets = data.batch(data.encode(data.load_text()), args.steps, args.batch, args.seq)
    with torch.no_grad():
        result["single_process_eval_loss"] = plain(idx, targets).item()
    result["checkpoint_step"] = meta["step"]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
