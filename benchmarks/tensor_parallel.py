"""Tensor parallelism against PyTorch's DTensor TP, and the fused CPU ``gelu_linear`` against eager.

Part 1 (2 ranks via pyparallel.launch, gloo): a stack of the built-in GPT's blocks, parallelized by
``pyparallel.tensor_parallel.parallelize`` (Megatron layers, one f per attention, GeLU fused into the MLP's
row-parallel matmul) and, on an identical copy, by ``torch.distributed.tensor.parallel.parallelize_module``
with ColwiseParallel (q, k, v, fc_in) / RowwiseParallel (o_proj, fc_out). Each iteration times one training
step (forward, backward, AdamW) of each, order alternating, after a barrier; medians and their ratio.
Collectives per step: ours from comm_stats, DTensor's from CommDebugMode.

Part 2 (one process): ``gelu_linear(z, b, w)`` against eager ``F.gelu(z + b) @ w.T`` on several MLP
shapes, forward + backward, alternating; medians, ratio, and the activation bytes autograd keeps.

    python benchmarks/tensor_parallel.py --steps 20 --op-iters 15
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, median, table, write_json  # noqa: E402

import pyparallel  # noqa: E402
from pyparallel import _ops, comm  # noqa: E402
from pyparallel.models.gpt import Block, gpt_config  # noqa: E402


def _stack(cfg, seed):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)])


def _dtensor(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(len(model)):
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{i}.attn.{proj}"] = ColwiseParallel()
        plan[f"{i}.attn.o_proj"] = RowwiseParallel()
        plan[f"{i}.mlp.fc_in"] = ColwiseParallel()
        plan[f"{i}.mlp.fc_out"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _step(model, opt, x):
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.item()


def tp_worker(preset, steps, warmup, batch, seq):
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = pyparallel.init(tp=int(os.environ["WORLD_SIZE"]))
    cfg = gpt_config(preset)
    ours = pyparallel.tensor_parallel.parallelize(_stack(cfg, 0), mesh,
                                                  {"*.attn": "attention", "*.mlp": "gelu_mlp"})
    theirs = _dtensor(_stack(cfg, 0), mesh.tp)
    runs = {"pyparallel TP": ours, "DTensor TP": theirs}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for k, m in runs.items()}
    times = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    gen = torch.Generator().manual_seed(1)
    for it in range(warmup + steps):
        x = torch.randn(batch, seq, cfg.n_embd, generator=gen)
        for name in (list(runs) if it % 2 == 0 else list(reversed(runs))):
            comm.barrier(mesh.tp_group)
            with Timer() as t:
                losses[name].append(_step(runs[name], opts[name], x))
            if it >= warmup:
                times[name].append(t.seconds)
    pyparallel.reset_comm_stats()
    _step(ours, opts["pyparallel TP"], x)
    our_calls = {k: v["calls"] for k, v in pyparallel.comm_stats()["by_op"].items()}
    with CommDebugMode() as debug:
        _step(theirs, opts["DTensor TP"], x)
    their_calls = {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}
    return {"times": times, "losses": losses, "our_calls": our_calls, "their_calls": their_calls}


def _op_step(fn, z, b, w, g):
    y = fn(z, b, w)
    y.backward(g)


def _eager(z, b, w):
    return F.gelu(z + b, approximate="tanh") @ w.t()  # [M, K] @ [K, N]


def _fused(z, b, w):
    return _ops.gelu_linear(z, b, w, "tanh")


def _saved_bytes(fn, z, b, w):
    params = {b.data_ptr(), w.data_ptr()}
    seen = {}

    def pack(t):
        seen[t.data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(z, b, w)
    # Activations autograd keeps for backward, parameters aside: eager keeps z + b and gelu(z + b) (in an
    # MLP, z + b is the first layer's output); the fused op keeps z only.
    return sum(t.numel() * t.element_size() for p, t in seen.items() if p not in params)


def op_bench(shapes, iters, dtype):
    rows = []
    for m, k, n in shapes:
        gen = torch.Generator().manual_seed(0)
        z = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
        b = torch.randn(k, generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).requires_grad_()
        g = torch.randn(m, n, generator=gen).to(dtype)
        # The same three GEMMs on a precomputed activation, no elementwise work at all: no fusion of the
        # bias + GeLU into the matmul can run faster than this, so eager / gemms bounds any speedup.
        act = F.gelu(z + b, approximate="tanh").detach().requires_grad_()
        fns = {"eager": _eager, "fused": _fused, "gemms": lambda z, b, w, act=act: act @ w.t()}
        times = {name: [] for name in fns}
        for it in range(iters + 2):
            for name in (list(fns) if it % 2 == 0 else list(reversed(fns))):  # alternate the order
                with Timer() as t:
                    _op_step(fns[name], z, b, w, g)
                if it >= 2:
                    times[name].append(t.seconds)
                z.grad = b.grad = w.grad = act.grad = None
        eager, fused, gemms = median(times["eager"]), median(times["fused"]), median(times["gemms"])
        rows.append({"M x K -> N": f"{m} x {k} -> {n}", "dtype": str(dtype).split(".")[-1],
                     "eager fwd+bwd (ms)": eager * 1e3, "fused fwd+bwd (ms)": fused * 1e3,
                     "speedup (eager/fused)": eager / fused, "GEMMs only (ms)": gemms * 1e3,
                     "bound (eager/GEMMs)": eager / gemms,
                     "saved MiB eager": _saved_bytes(_eager, z, b, w) / 2**20,
                     "saved MiB fused": _saved_bytes(_fused, z, b, w) / 2**20})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--op-iters", type=int, default=15)
    ap.add_argument("--skip-tp", action="store_true")
    ap.add_argument("--op-threads", default="1,all", help="thread counts for the op benchmark ('all' = cores)")
    ap.add_argument("--json", default="benchmarks/out/tensor_parallel.json")
    a = ap.parse_args()
    out = {"config": vars(a)}
    if not a.skip_tp:
        res = pyparallel.launch(tp_worker, 2, (a.preset, a.steps, a.warmup, a.batch, a.seq),
                                env={"OMP_NUM_THREADS": "1"})[0]
        ours, theirs = median(res["times"]["pyparallel TP"]), median(res["times"]["DTensor TP"])
        tp_rows = [
            {"impl": "pyparallel TP", "median step (ms)": ours * 1e3, "ratio vs DTensor": ours / theirs,
             "collectives/step": str(res["our_calls"])},
            {"impl": "DTensor TP", "median step (ms)": theirs * 1e3, "ratio vs DTensor": 1.0,
             "collectives/step": str(res["their_calls"])},
        ]
        cfg = gpt_config(a.preset)
        print(f"GPT blocks {a.preset!r} ({cfg.n_layer} x h={cfg.n_embd}, {cfg.n_head} heads), tp=2 (gloo, 1 thread "
              f"per rank), batch {a.batch} x seq {a.seq}, {a.steps} timed steps (fwd+bwd+AdamW)")
        print(table(tp_rows, list(tp_rows[0])))
        out["tp"] = {"rows": tp_rows, "raw": res}
    shapes = [(2048, 512, 128), (2048, 1024, 256), (4096, 768, 768), (1024, 3072, 768)]
    out["gelu_linear"] = []
    for threads in a.op_threads.split(","):
        torch.set_num_threads(os.cpu_count() or 1 if threads == "all" else int(threads))
        op_rows = op_bench(shapes, a.op_iters, torch.float32) + op_bench(shapes[:2], a.op_iters, torch.bfloat16)
        for r in op_rows:
            r["threads"] = torch.get_num_threads()
        print(f"\ngelu_linear (tanh) on CPU, {torch.get_num_threads()} thread(s), {a.op_iters} iterations, "
              f"forward + backward")
        print(table(op_rows, list(op_rows[0])))
        out["gelu_linear"] += op_rows
    write_json(a.json, out)


if __name__ == "__main__":
    main()
