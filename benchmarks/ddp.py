"""pyparallel.DataParallel against torch.nn.parallel.DistributedDataParallel, alternating in one run.

Both wrap identical copies of the same GPT on the same ranks and data, with the same bucket size; each
iteration times one step of each (order alternating), after a barrier. Reports the median step time of
each, their ratio (ours / torch's) and our bytes per step against the ring minimum 2(N-1)/N * Psi * 4.

    python benchmarks/ddp.py --nprocs 2 --preset bench --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, median, table, write_json  # noqa: E402

import pyparallel  # noqa: E402
from pyparallel import comm  # noqa: E402
from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch  # noqa: E402


def _step(wrapped, opt, idx, tgt):
    loss = wrapped(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep gradient buffers (both wrappers reuse them)
    return loss


def worker(preset, steps, warmup, batch, seq, bucket_mb):
    from torch.nn.parallel import DistributedDataParallel

    mesh = pyparallel.init()
    cfg = gpt_config(preset)
    ours_model, torch_model = GPT(cfg, seed=0), GPT(cfg, seed=0)
    ours = pyparallel.DataParallel(ours_model, mesh, bucket_cap_mb=bucket_mb)
    theirs = DistributedDataParallel(torch_model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True,
                                     process_group=mesh.dp_group.pg)
    runs = {
        "pyparallel": (ours, torch.optim.AdamW(ours_model.parameters(), lr=1e-4)),
        "torch DDP": (theirs, torch.optim.AdamW(torch_model.parameters(), lr=1e-4)),
    }
    times = {k: [] for k in runs}
    local = batch // mesh.dp
    bytes_per_step = None
    for it in range(warmup + steps):
        idx, tgt = synthetic_batch(cfg, batch, seq, seed=it)
        rows = slice(mesh.dp_rank * local, (mesh.dp_rank + 1) * local)
        idx, tgt = idx[rows], tgt[rows]
        order = list(runs) if it % 2 == 0 else list(reversed(runs))
        for name in order:
            comm.barrier(mesh.dp_group)
            pyparallel.reset_comm_stats()
            with Timer() as t:
                _step(*runs[name], idx, tgt)
            if name == "pyparallel":
                bytes_per_step = pyparallel.comm_stats()["by_op_axis"]["all_reduce@dp"]
            if it >= warmup:
                times[name].append(t.seconds)
    psi = sum(p.numel() for p in ours_model.parameters())
    return {"times": times, "bytes": bytes_per_step, "psi": psi, "n": mesh.dp,
            "buckets": len(ours.buckets)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--json", default="benchmarks/out/ddp.json")
    a = ap.parse_args()
    res = pyparallel.launch(worker, a.nprocs, (a.preset, a.steps, a.warmup, a.batch, a.seq, a.bucket_mb),
                            env={"OMP_NUM_THREADS": "1"})[0]
    n, psi = res["n"], res["psi"]
    ring_min = 2 * (n - 1) / n * psi * 4
    ours, theirs = median(res["times"]["pyparallel"]), median(res["times"]["torch DDP"])
    rows = [
        {"impl": "pyparallel.DataParallel", "median step (ms)": ours * 1e3, "ratio vs torch": ours / theirs,
         "wire bytes/step": res["bytes"]["wire_bytes"], "ring minimum": round(ring_min)},
        {"impl": "torch DDP", "median step (ms)": theirs * 1e3, "ratio vs torch": 1.0,
         "wire bytes/step": None, "ring minimum": round(ring_min)},
    ]
    print(f"GPT preset {a.preset!r}: {psi:,} parameters, {n} ranks (gloo), bucket {a.bucket_mb} MiB "
          f"({res['buckets']} buckets), {a.steps} timed steps, batch {a.batch} x seq {a.seq}")
    print(table(rows, list(rows[0])))
    write_json(a.json, {"config": vars(a), "rows": rows, "raw": res})


if __name__ == "__main__":
    main()
