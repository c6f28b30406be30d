"""How close a ZeRO row can come to DeepSpeed's: the compute both stand on, timed alternating with them.

Our ZeRO-1/2 rows and DeepSpeed's run the same forward and backward on each rank's rows of the batch; what
separates them is the gradient reduction, the hooks around backward, and the optimizer step. So beside
each pair (the rows of ``pyparallel bench``, built by its adapters: same model, hyper-parameters, data and
ranks) this times the **floor**: the same model's forward and backward on the rank's rows and nothing
else — no reduction, no optimizer step (bf16 weights under ``--dtype bf16``, as both engines compute).
Each iteration runs the three after a barrier, in an order that rotates. ``floor / DeepSpeed`` is the
lowest ``ours / DeepSpeed`` any engine could reach on this machine and model, even with free
communication and a free optimizer.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/zero_floor.py --rows zero1,zero2 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, table, write_json  # noqa: E402

import pyparallel  # noqa: E402
from pyparallel.bench import deepspeed_peers, measure, runner, specs, strategies  # noqa: E402
from pyparallel.bench.adapter import Hyper, dp_rows  # noqa: E402


class Floor:
    """Forward and backward of one replica's rows: what every data-parallel engine computes per step."""

    def __init__(self, mesh, cfg, hp: Hyper):
        import torch

        from pyparallel.models.gpt import GPT

        self.mesh = mesh
        self.model = GPT(cfg, seed=hp.seed).to(mesh.device)
        if hp.dtype == "bf16":
            self.model = self.model.to(torch.bfloat16)

    def step(self, idx, tgt):
        idx, tgt = (dp_rows(t, self.mesh.dp, self.mesh.dp_rank) for t in (idx, tgt))
        self.model.zero_grad(set_to_none=False)
        self.model(idx, tgt).backward()


def worker(config: runner.BenchConfig, rows: list[str]) -> dict:
    from pyparallel import comm

    measure.fast_mode()
    base = pyparallel.init(backend="gloo")
    deepspeed_peers.preload("gloo")
    cfg = config.gpt()
    runner._warm_up(cfg, base.device, config)
    batches = runner._batches(config, cfg, base.device)
    table_ = specs.known(config.nprocs)
    out = {}
    for row in rows:
        runs = {}
        for name in (row, f"deepspeed-{row}"):
            spec = table_[name]
            runs[name] = strategies.build(spec, pyparallel.init(dp=spec.dp), cfg, config.hp, config.microbatches)
        runs["floor"] = Floor(pyparallel.init(dp=config.nprocs), cfg, config.hp)
        names, times = list(runs), {k: [] for k in runs}
        for i, (idx, tgt) in enumerate(batches):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                comm.barrier(base.world_group)
                with measure.StepTimer(base.device) as timer:
                    runs[name].step(idx, tgt)
                if i >= config.warmup:
                    times[name].append(timer.seconds)
        out[row] = times
        del runs
        measure.settle()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="zero1,zero2", help="our ZeRO rows, each timed with its DeepSpeed peer")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--model", default="small-test")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--json", default="benchmarks/out/zero_floor.json")
    a = ap.parse_args()
    missing = deepspeed_peers.unavailable()
    if missing:
        sys.exit(f"DeepSpeed rows skipped: {missing}")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    config = runner.BenchConfig(nprocs=a.nprocs, model=a.model, batch=a.batch, seq=a.seq, steps=a.steps,
                                warmup=a.warmup, hp=Hyper(dtype=a.dtype))
    per_rank = pyparallel.launch(worker, a.nprocs, (config, rows), env={"OMP_NUM_THREADS": "1"})
    out = []
    for row in rows:
        # a step ends when its slowest rank does: the per-iteration maximum over ranks
        med = {name: median([max(ts) for ts in zip(*(r[row][name] for r in per_rank))]) * 1e3
               for name in per_rank[0][row]}
        ds = med[f"deepspeed-{row}"]
        out.append({"row": row, "dtype": a.dtype, "ours ms": med[row], "deepspeed ms": ds,
                    "floor ms": med["floor"], "ours/deepspeed": med[row] / ds, "floor/deepspeed": med["floor"] / ds,
                    "ours - floor ms": med[row] - med["floor"], "deepspeed - floor ms": ds - med["floor"]})
    print(f"GPT {a.model!r}, batch {a.batch} x seq {a.seq} over {a.nprocs} ranks, {a.dtype}, gloo on CPU, "
          f"{a.steps} timed steps (median of the slowest rank), {os.cpu_count()} cores")
    print(table(out, list(out[0])))
    write_json(a.json, {"config": vars(a), "rows": out, "raw": per_rank})


if __name__ == "__main__":
    main()
