"""pyparallel.comm's all-gather, reduce-scatter and (2 ranks) send/recv against torch.distributed's own,
alternating in one run.

On gloo, ``comm.all_gather`` and ``comm.reduce_scatter`` take direct paths from 256 KiB (N concurrent
broadcasts; an exchange of slices, see pyparallel/comm.py); the peers are ``dist.all_gather_into_tensor``
and ``dist.reduce_scatter_tensor`` on the same group and tensors. Each iteration times one call of each
(order alternating) after a barrier; reported per size: median wall and CPU time (all threads of the
process, gloo's included) of each, and ours / torch's. ``send_recv`` is a round trip of one message of MB
megabytes (rank 0 to rank 1 and back; the median call times 8 of them), the pipeline's links on one host.

    python benchmarks/comm.py --nprocs 2 --sizes 65536 262144 3715584 --iters 30
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, table, write_json  # noqa: E402

import pyparallel  # noqa: E402
from pyparallel import comm  # noqa: E402

ROUND_TRIPS = 8  # per timed send_recv call, so that the ranks' skew leaving the barrier is spread thin


def _ping_pong(group, send, recv, msg: torch.Tensor, back: torch.Tensor):
    """Rank 0 sends ``msg`` to rank 1, which sends it back, ROUND_TRIPS times."""
    def call():
        for _ in range(ROUND_TRIPS):
            if group.rank == 0:
                send(msg, 1)
                recv(back, 1)
            elif group.rank == 1:
                recv(back, 0)
                send(back, 0)
    return call


def _calls(group, numel: int) -> dict:
    n, pg = group.size, group.pg
    full, shard = torch.randn(numel // n * n), torch.randn(numel // n)
    out = torch.empty(numel // n)
    calls = {
        ("all_gather", "pyparallel"): lambda: comm.all_gather(full, shard, group),
        ("all_gather", "torch"): lambda: dist.all_gather_into_tensor(full, shard, group=pg),
        ("reduce_scatter", "pyparallel"): lambda: comm.reduce_scatter(out, full, group, op="sum"),
        ("reduce_scatter", "torch"): lambda: dist.reduce_scatter_tensor(out, full, group=pg),
    }
    if n == 2:  # a pipeline link: comm.send/recv (a two-rank group) against dist.send/recv on the same group
        msg, back = torch.randn(numel // n), torch.empty(numel // n)
        calls[("send_recv", "pyparallel")] = _ping_pong(group, lambda t, r: comm.send(t, r, group),
                                                        lambda t, r: comm.recv(t, r, group), msg, back)
        calls[("send_recv", "torch")] = _ping_pong(group, lambda t, r: dist.send(t, group.ranks[r], group=pg),
                                                   lambda t, r: dist.recv(t, group.ranks[r], group=pg), msg, back)
    return calls


def worker(sizes, iters, warmup):
    mesh = pyparallel.init()
    group = mesh.world_group
    out = {}
    for numel in sizes:
        calls = _calls(group, numel)
        wall = {k: [] for k in calls}
        cpu = {k: [] for k in calls}
        for it in range(warmup + iters):
            order = list(calls) if it % 2 == 0 else list(reversed(calls))
            for key in order:
                comm.barrier(group)
                c0, t0 = time.process_time(), time.perf_counter()
                calls[key]()
                t1, c1 = time.perf_counter(), time.process_time()
                if it >= warmup:
                    wall[key].append(t1 - t0)
                    cpu[key].append(c1 - c0)
        out[numel] = {f"{op}/{impl}": (median(wall[(op, impl)]), median(cpu[(op, impl)])) for op, impl in calls}
    return {"n": group.size, "results": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[65536, 262144, 3715584],
                    help="fp32 elements of the all-gather output / reduce-scatter input")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/out/comm.json")
    a = ap.parse_args()
    res = pyparallel.launch(worker, a.nprocs, (a.sizes, a.iters, a.warmup), env={"OMP_NUM_THREADS": "1"})[0]
    rows = []
    for numel, r in res["results"].items():
        for op in ("all_gather", "reduce_scatter", "send_recv"):
            if f"{op}/pyparallel" not in r:
                continue
            (ow, oc), (tw, tc) = r[f"{op}/pyparallel"], r[f"{op}/torch"]
            mb = numel * 4 / 2**20
            if op == "send_recv":  # per round trip of a message of half the collectives' size
                mb /= res["n"]
                ow, oc, tw, tc = (x / ROUND_TRIPS for x in (ow, oc, tw, tc))
            rows.append({"op": op, "MB": mb, "ours ms": ow * 1e3, "torch ms": tw * 1e3,
                         "ours/torch": ow / tw, "ours CPU ms": oc * 1e3, "torch CPU ms": tc * 1e3,
                         "CPU ours/torch": oc / tc})
    print(f"gloo, {res['n']} ranks, 1 thread per rank, {a.iters} alternating calls each, medians")
    print(table(rows, list(rows[0])))
    write_json(a.json, {"config": vars(a), "rows": rows, "raw": res})


if __name__ == "__main__":
    main()
