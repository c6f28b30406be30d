"""pyparallel's pipeline schedules against torch.distributed.pipelining, alternating in one run.

For each schedule — GPipe, 1F1B, interleaved 1F1B (v = 2) — both implementations run the same GPT, cut
at the same block boundaries (balanced by estimated FLOPs, so the bubble is the schedule's and not an
uneven split's; the default vocabulary of 512 makes the head cost about a sixth of a layer, which keeps
that split within a few per cent of even), on the same ranks and data: ``PipelineParallel`` against ``PipelineStage`` +
``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``. Each iteration times one step of each
(order alternating) from a barrier to the end of the slowest rank's step; forward + backward only (the
optimizer is not part of the pipeline). Reports median step times and their ratio, our measured bubble
against the theory (p - 1) / (v m + p - 1) — over all timed steps ("bubble meas", the mean over stages
of idle / (busy + idle)) and as the median over steps (robust to a step the OS scheduler stretched) —
and the peak bytes of saved activations per stage, measured for both with the same autograd
saved-tensor hooks.

    python benchmarks/pipeline.py --nprocs 2 4 --steps 8

On a 2-core machine with 4 processes two stages share each core, so step times and the bubble there
measure the operating system's scheduler as much as the pipeline: read the 4-rank rows as indicative.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, table, write_json  # noqa: E402

import pyparallel  # noqa: E402
from pyparallel import comm  # noqa: E402
from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch  # noqa: E402
from pyparallel.pipeline_parallel import (  # noqa: E402
    PipelineParallel,
    SavedTensorMeter,
    balance,
    to_blocks,
    token_cross_entropy,
)

SCHEDULES = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"),
             ("interleaved", 2, "ScheduleInterleaved1F1B")]


def flop_costs(cfg, seq: int) -> list[int]:
    """Multiply-adds per token of each block: embedding ~0, a layer 12 h^2 + 2 s h, the head h V."""
    h = cfg.n_embd
    return [1] + [12 * h * h + 2 * seq * h] * cfg.n_layer + [h * cfg.vocab_size]


class TorchPeer:
    """torch.distributed.pipelining on the same split: one PipelineStage per local chunk."""

    def __init__(self, blocks, bounds, mesh, schedule_cls: str, m: int):
        from torch.distributed import pipelining

        p, n_chunks = mesh.pp, len(bounds) - 1
        self.mesh = mesh
        self.modules = [nn.Sequential(*blocks[bounds[c]:bounds[c + 1]]) for c in range(mesh.pp_rank, n_chunks, p)]
        stages = [pipelining.PipelineStage(mod, c, n_chunks, mesh.device, group=mesh.pp_group.pg)
                  for mod, c in zip(self.modules, range(mesh.pp_rank, n_chunks, p))]
        cls = getattr(pipelining, schedule_cls)
        arg = stages if schedule_cls == "ScheduleInterleaved1F1B" else stages[0]
        self.schedule = cls(arg, m, loss_fn=token_cross_entropy)

    def parameters(self):
        for mod in self.modules:
            yield from mod.parameters()

    def step(self, idx, tgt):
        first, last = self.mesh.pp_rank == 0, self.mesh.pp_rank == self.mesh.pp - 1
        losses = []
        if first:
            self.schedule.step(idx, target=tgt if last else None, losses=losses if last else None)
        elif last:
            self.schedule.step(target=tgt, losses=losses)
        else:
            self.schedule.step()


def timed(fn, mesh) -> float:
    """Seconds from a common start (barrier) to the end of the slowest rank's step."""
    comm.barrier(mesh.world_group)
    start = time.perf_counter()
    fn()
    mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    comm.all_reduce(mine, mesh.world_group, op="max")
    return float(mine.item())


def peak_bytes(fn, params, mesh) -> list[int]:
    meter = SavedTensorMeter(exclude=list(params))
    with meter:
        fn()
    return comm.all_gather_object(meter.peak, mesh.pp_group)


def bench_schedule(mesh, cfg, data, schedule: str, v: int, torch_cls: str, args) -> dict:
    m = args.microbatches
    ours_model, torch_model = GPT(cfg, seed=0), GPT(cfg, seed=0)
    blocks, _ = to_blocks(torch_model)
    bounds = balance(flop_costs(cfg, args.seq), mesh.pp * v)
    ours = PipelineParallel(ours_model, mesh, schedule=schedule, num_microbatches=m, virtual_stages=v,
                            boundaries=bounds)
    theirs = TorchPeer(blocks, bounds, mesh, torch_cls, m)
    runs = {"ours": ours.step, "torch": theirs.step}
    times = {k: [] for k in runs}
    for it, (idx, tgt) in enumerate(data):
        if it == args.warmup:
            ours.reset_stats()
        for name in (list(runs) if it % 2 == 0 else list(reversed(runs))):
            t = timed(functools.partial(runs[name], idx, tgt), mesh)
            if it >= args.warmup:
                times[name].append(t)
        for model in (ours_model, torch_model):
            model.zero_grad(set_to_none=False)
    st = ours.stats()
    idx, tgt = data[0]
    return {"schedule": schedule, "p": mesh.pp, "v": v, "m": m, "bounds": bounds,
            "ours_s": times["ours"], "torch_s": times["torch"],
            "bubble_measured": st["bubble_measured"], "bubble_theory": st["bubble_theory"],
            "bubble_median_step": st["bubble_measured_median_step"],
            "bubble_per_stage": [s["bubble"] for s in st["stages"]],
            "busy_s_per_stage": [s["busy_s"] for s in st["stages"]],
            "peak_inflight": st["peak_inflight"],
            "ours_act_bytes": peak_bytes(functools.partial(ours.step, idx, tgt), ours.parameters(), mesh),
            "torch_act_bytes": peak_bytes(functools.partial(theirs.step, idx, tgt), theirs.parameters(), mesh)}


def worker(args):
    mesh = pyparallel.init(pp=int(os.environ["WORLD_SIZE"]))
    # Untied: torch.distributed.pipelining does not synchronise weights shared across stages.
    cfg = gpt_config(args.preset, n_layer=args.layers, vocab_size=args.vocab, tie_embeddings=False)
    data = [synthetic_batch(cfg, args.batch, args.seq, seed=s) for s in range(args.warmup + args.steps)]
    return [bench_schedule(mesh, cfg, data, *sched, args) for sched in SCHEDULES]


def summarise(raw: list[dict]) -> list[dict]:
    rows = []
    for r in raw:
        ours, theirs = median(r["ours_s"]), median(r["torch_s"])
        rows.append({
            "p": r["p"], "schedule": r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else ""), "m": r["m"],
            "ours ms": ours * 1e3, "torch ms": theirs * 1e3, "ours/torch": ours / theirs,
            "bubble theory": r["bubble_theory"], "bubble meas": r["bubble_measured"],
            "meas/theory": r["bubble_measured"] / r["bubble_theory"],
            "median-step meas/theory": r["bubble_median_step"] / r["bubble_theory"],
            "in-flight/stage": "/".join(map(str, r["peak_inflight"])),
            "ours act MB/stage": "/".join(f"{b / 2**20:.1f}" for b in r["ours_act_bytes"]),
            "torch act MB/stage": "/".join(f"{b / 2**20:.1f}" for b in r["torch_act_bytes"]),
        })
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/out/pipeline.json")
    a = ap.parse_args()
    raw = []
    for n in a.nprocs:
        raw += pyparallel.launch(worker, n, (a,), env={"OMP_NUM_THREADS": "1"})[0]
    rows = summarise(raw)
    cfg = gpt_config(a.preset, n_layer=a.layers, vocab_size=a.vocab)
    print(f"GPT preset {a.preset!r} with {a.layers} layers (untied), batch {a.batch} x seq {a.seq}, "
          f"{a.microbatches} micro-batches, gloo on CPU, {a.steps} timed steps (median), "
          f"{os.cpu_count()} cores; vocab {cfg.vocab_size}, width {cfg.n_embd}")
    print(table(rows, list(rows[0])))
    write_json(a.json, {"config": vars(a), "rows": rows, "raw": raw})


if __name__ == "__main__":
    main()
