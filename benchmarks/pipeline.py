"""pyparallel's pipeline schedules against torch.distributed.pipelining, alternating in one run.

For each schedule — GPipe, 1F1B, interleaved 1F1B (v = 2), ZB-H1 and ZBV (zero bubble, Qi et al. 2023) —
both implementations run the same GPT, cut at the same block boundaries (balanced by estimated FLOPs, so
the bubble is the schedule's and not an uneven split's; the default vocabulary of 512 makes the head cost
about a sixth of a layer, which keeps that split within a few per cent of even), on the same ranks and
data: ``PipelineParallel`` against ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``. The zero-bubble rows have two peers: torch's ``Schedule1F1B`` (on the 1F1B
row's split) and torch's own zero-bubble schedule on the same split as ours
(``ScheduleInterleavedZeroBubble`` with one stage per rank for ZB-H1, ``ScheduleZBVZeroBubble`` with the
V placement for ZBV). Each iteration times one step of each (order rotating) from a barrier to the end
of the slowest rank's step; forward + backward only (the optimizer is not part of the pipeline). Reports
median step times and their ratios, our measured bubble against the theory ((p - 1) / (v m + p - 1), or
the zero-bubble lists' simulated bubble at equal F, B, W times) — over all timed steps ("bubble meas",
the mean over stages of idle / (busy + idle)) and as the median over steps (robust to a step the OS
scheduler stretched) — and the peak bytes of saved activations per stage, measured for both with the
same autograd saved-tensor hooks. Both pipelines run their steps with Python's automatic garbage
collection held (``PipelineParallel.step`` does so itself, the torch peer's step is wrapped alike), so a
collection never lands inside either's schedule and the comparison is of the schedules. "free-split sim
/ 1F1B sim" (ZB-H1 rows) replays ZB-H1's lists with this run's measured forward times and each stage's
1F1B backward split in two equal free halves, over 1F1B's lists at their measured times: the step ratio
the schedule itself could reach on this split and machine if splitting cost nothing.

    python benchmarks/pipeline.py --nprocs 2 4 --steps 8
    python benchmarks/pipeline.py --nprocs 2 --schedules 1f1b zb-h1 zbv

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
from pyparallel import collector, comm  # noqa: E402
from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch  # noqa: E402
from pyparallel.pipeline_parallel import (  # noqa: E402
    PipelineParallel,
    SavedTensorMeter,
    balance,
    schedules,
    to_blocks,
    token_cross_entropy,
)

# (ours, virtual stages, torch peers: the matching schedule first)
SCHEDULES = [("gpipe", 1, ["ScheduleGPipe"]), ("1f1b", 1, ["Schedule1F1B"]),
             ("interleaved", 2, ["ScheduleInterleaved1F1B"]),
             ("zb-h1", 1, ["Schedule1F1B", "ScheduleInterleavedZeroBubble"]),
             ("zbv", 2, ["Schedule1F1B", "ScheduleZBVZeroBubble"])]
_MULTI_STAGE = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


def flop_costs(cfg, seq: int) -> list[int]:
    """Multiply-adds per token of each block: embedding ~0, a layer 12 h^2 + 2 s h, the head h V."""
    h = cfg.n_embd
    return [1] + [12 * h * h + 2 * seq * h] * cfg.n_layer + [h * cfg.vocab_size]


class TorchPeer:
    """torch.distributed.pipelining on the same split: one PipelineStage per local chunk."""

    def __init__(self, blocks, bounds, mesh, schedule_cls: str, m: int):
        from torch.distributed import pipelining

        p, n_chunks, r = mesh.pp, len(bounds) - 1, mesh.pp_rank
        self.mesh = mesh
        # ZBV's V: chunks r and 2p-1-r on rank r (the placement torch's ZBV schedule expects, as ours)
        mine = [r, 2 * p - 1 - r] if schedule_cls == "ScheduleZBVZeroBubble" else list(range(r, n_chunks, p))
        self.first, self.last = 0 in mine, n_chunks - 1 in mine
        self.modules = [nn.Sequential(*blocks[bounds[c]:bounds[c + 1]]) for c in mine]
        stages = [pipelining.PipelineStage(mod, c, n_chunks, mesh.device, group=mesh.pp_group.pg)
                  for mod, c in zip(self.modules, mine)]
        cls = getattr(pipelining, schedule_cls)
        arg = stages if schedule_cls in _MULTI_STAGE else stages[0]
        self.schedule = cls(arg, m, loss_fn=token_cross_entropy)

    def parameters(self):
        for mod in self.modules:
            yield from mod.parameters()

    def step(self, idx, tgt):
        with collector.held():  # as ours (PipelineParallel.step): schedules compared, not collector policy
            self._step(idx, tgt)

    def _step(self, idx, tgt):
        first, last = self.first, self.last
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


def bench_schedule(mesh, cfg, data, schedule: str, v: int, torch_classes: list[str], args) -> dict:
    m = args.microbatches
    ours_model = GPT(cfg, seed=0)
    bounds = balance(flop_costs(cfg, args.seq), mesh.pp * v)
    ours = PipelineParallel(ours_model, mesh, schedule=schedule, num_microbatches=m, virtual_stages=v,
                            boundaries=bounds)
    runs, models, peers = {"ours": ours.step}, [ours_model], {}
    for cls in torch_classes:
        peer_model = GPT(cfg, seed=0)
        blocks, _ = to_blocks(peer_model)
        peer_v = 2 if cls in _MULTI_STAGE and cls != "ScheduleInterleavedZeroBubble" else 1
        peer_bounds = bounds if peer_v == v else balance(flop_costs(cfg, args.seq), mesh.pp * peer_v)
        peers[cls] = TorchPeer(blocks, peer_bounds, mesh, cls, m)
        runs[cls] = peers[cls].step
        models.append(peer_model)
    names = list(runs)
    times = {k: [] for k in runs}
    for it, (idx, tgt) in enumerate(data):
        if it == args.warmup:
            ours.reset_stats()
        k = it % len(names)
        for name in names[k:] + names[:k]:  # rotating order: each runs first equally often
            t = timed(functools.partial(runs[name], idx, tgt), mesh)
            if it >= args.warmup:
                times[name].append(t)
        for model in models:
            model.zero_grad(set_to_none=False)
    st = ours.stats()
    idx, tgt = data[0]
    first = peers[torch_classes[0]]
    return {"schedule": schedule, "p": mesh.pp, "v": v, "m": m, "bounds": bounds,
            "ours_s": times["ours"], "torch_s": times[torch_classes[0]], "torch_cls": torch_classes,
            "torch_zb_s": times[torch_classes[1]] if len(torch_classes) > 1 else None,
            "bubble_measured": st["bubble_measured"], "bubble_theory": st["bubble_theory"],
            "bubble_median_step": st["bubble_measured_median_step"],
            "bubble_per_stage": [s["bubble"] for s in st["stages"]],
            "busy_s_per_stage": [s["busy_s"] for s in st["stages"]],
            "bubble_simulated": st["bubble_simulated"],
            "action_s_per_stage": [s["action_s"] for s in st["stages"]],
            "microbatches_per_stage": [s["microbatches"] for s in st["stages"]],
            "weight_s_per_stage": [s["weight_s"] for s in st["stages"]],
            "early_w_per_stage": [s["early_w"] for s in st["stages"]],
            "split": st["split"],
            "peak_inflight": st["peak_inflight"],
            "ours_act_bytes": peak_bytes(functools.partial(ours.step, idx, tgt), ours.parameters(), mesh),
            "torch_act_bytes": peak_bytes(functools.partial(first.step, idx, tgt), first.parameters(), mesh)}


def worker(args):
    mesh = pyparallel.init(pp=int(os.environ["WORLD_SIZE"]))
    # Untied: torch.distributed.pipelining does not synchronise weights shared across stages.
    cfg = gpt_config(args.preset, n_layer=args.layers, vocab_size=args.vocab, tie_embeddings=False)
    data = [synthetic_batch(cfg, args.batch, args.seq, seed=s) for s in range(args.warmup + args.steps)]
    return [bench_schedule(mesh, cfg, data, *sched, args) for sched in SCHEDULES if sched[0] in args.schedules]


def _per_mb(r: dict, rank: int) -> dict:
    """Measured seconds per micro-batch of each action of stage ``rank`` (keys "F0", "B0", "W0", ...)."""
    return {k: t / r["microbatches_per_stage"][rank] for k, t in r["action_s_per_stage"][rank].items()}


def free_split(zb: dict, base: dict) -> float | None:
    """ZB-H1's step with a free split over 1F1B's, both simulated at this run's measured times
    (``schedules.play``, free messages): F as measured in the ZB-H1 row, B = W = half of each stage's
    whole backward as measured in the 1F1B row (the first stage's all W: its input needs no gradient).
    What ZB-H1's lists could give on this split and machine if splitting a backward cost nothing; above
    0.92 the step target is out of reach for the schedule itself."""
    if zb["schedule"] != "zb-h1" or base["schedule"] != "1f1b" or zb["p"] != base["p"] or zb["m"] != base["m"]:
        return None
    p, m = zb["p"], zb["m"]
    full = [_per_mb(base, r)[f"B{r}"] for r in range(p)]
    fwd = [_per_mb(zb, r)[f"F{r}"] for r in range(p)]
    cost = {r: {"F": fwd[r], "B": 0.0 if r == 0 else full[r] / 2, "W": full[r] if r == 0 else full[r] / 2}
            for r in range(p)}
    ideal = schedules.play([schedules.build("zb-h1", r, p, m) for r in range(p)], "zb-h1", p,
                           lambda r, a: cost[r][a.kind])["step"]
    base_cost = {r: {"F": _per_mb(base, r)[f"F{r}"], "B": full[r]} for r in range(p)}
    one_f = schedules.play([schedules.build("1f1b", r, p, m) for r in range(p)], "1f1b", p,
                           lambda r, a: base_cost[r][a.kind])["step"]
    return ideal / one_f


def summarise(raw: list[dict]) -> list[dict]:
    rows = []
    for r in raw:
        ours, theirs = median(r["ours_s"]), median(r["torch_s"])
        base = next((b for b in raw if b["schedule"] == "1f1b" and b["p"] == r["p"] and b["m"] == r["m"]), None)
        ideal = free_split(r, base) if base is not None else None
        rows.append({
            "p": r["p"], "schedule": r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else ""), "m": r["m"],
            "ours ms": ours * 1e3, "torch ms": theirs * 1e3, "ours/torch": ours / theirs,
            "torch zb ms": median(r["torch_zb_s"]) * 1e3 if r["torch_zb_s"] else "-",
            "ours/torch zb": ours / median(r["torch_zb_s"]) if r["torch_zb_s"] else "-",
            "bubble theory": r["bubble_theory"], "bubble meas": r["bubble_measured"],
            "bubble sim": r["bubble_simulated"],
            "meas/theory": r["bubble_measured"] / r["bubble_theory"],
            "median-step meas/theory": r["bubble_median_step"] / r["bubble_theory"],
            "free-split sim / 1F1B sim": ideal if ideal is not None else "-",
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
    ap.add_argument("--schedules", nargs="+", default=[s[0] for s in SCHEDULES],
                    choices=[s[0] for s in SCHEDULES])
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
