"""CPU Adam step time: pyparallel's CPUAdam vs torch.optim.Adam (fused / foreach) vs DeepSpeed's CPU Adam.

Adam reads p, g, m, v and writes p, m, v: 28 bytes of memory traffic per fp32 parameter, so on a large
model the step is bound by memory bandwidth. The roofline is this machine's in-place streaming bandwidth,
measured in the same run as ``a.add_(b)`` over tensors far larger than the caches (2 reads + 1 write per
element). Contenders run alternately, round after round, so that load from other processes on a shared
machine spreads over all of them; the table reports medians.

    python benchmarks/cpu_adam.py                       # 50M parameters, 2 threads
    python benchmarks/cpu_adam.py --params 10e6 --json benchmarks/out/cpu_adam.json

DeepSpeed (``pip install deepspeed``) JIT-builds its kernel with ninja on first use; when that (or the
import) fails, the table says so in its row instead of leaving it out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import traceback

import torch

from pyparallel.optim import CPUAdam, simd_level

BYTES_PER_PARAM = 28  # read p, g, m, v (16) + write p, m, v (12), fp32
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def _roofline(n: int, repeats: int) -> list[float]:
    """Seconds per in-place streaming pass a.add_(b) (12 bytes per element), ``repeats`` samples."""
    a, b = torch.randn(n), torch.randn(n)
    a.add_(b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - t0)
    return times


def _deepspeed(params):
    os.environ.setdefault("DS_BUILD_OPS", "0")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=False, **HYPER)


def _contenders(lowp: bool):
    out = {
        "pyparallel CPUAdam": lambda ps: CPUAdam(ps, adamw=False, **HYPER),
        "torch Adam(fused=True)": lambda ps: torch.optim.Adam(ps, fused=True, **HYPER),
        "torch Adam(foreach=True)": lambda ps: torch.optim.Adam(ps, foreach=True, **HYPER),
        "DeepSpeedCPUAdam": _deepspeed,
    }
    if lowp:  # what ZeRO-Offload ships back: the updated weights in bf16
        out["pyparallel CPUAdam + bf16 copy"] = "lowp"
        out["torch fused + bf16 copy (2 passes)"] = "torch-lowp"
    return out


class _Runner:
    """One contender: its own parameter and state, a shared read-only gradient."""

    def __init__(self, name, make, init: torch.Tensor, grad: torch.Tensor):
        self.name, self.error, self.times, self.lowp, self.second_pass = name, None, [], None, False
        try:
            self.param = torch.nn.Parameter(init.clone())
            self.param.grad = grad
            if make in ("lowp", "torch-lowp"):
                self.lowp = [torch.empty(init.numel(), dtype=torch.bfloat16)]
                self.opt = CPUAdam([self.param], adamw=False, **HYPER) if make == "lowp" else \
                    torch.optim.Adam([self.param], fused=True, **HYPER)
                self.second_pass = make == "torch-lowp"
            else:
                self.opt = make([self.param])
            self.step()  # state allocation and any JIT build happen here, untimed
        except Exception as exc:  # reported in the table (e.g. DeepSpeed's JIT build failing)
            self.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            self.trace = traceback.format_exc()

    def step(self):
        if self.second_pass:
            self.opt.step()
            self.lowp[0].copy_(self.param.detach())
        elif self.lowp is not None:
            self.opt.step(lowp_out=self.lowp)
        else:
            self.opt.step()

    def time(self, repeats: int) -> None:
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.step()
            self.times.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50e6, help="number of fp32 parameters (one flat tensor)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds over all contenders")
    ap.add_argument("--repeats", type=int, default=4, help="timed steps per contender per round")
    ap.add_argument("--no-lowp", action="store_true", help="skip the CPUAdam + bf16 copy row")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.params)
    gen = torch.Generator().manual_seed(0)
    init, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    runners = [_Runner(name, make, init, grad) for name, make in _contenders(not args.no_lowp).items()]
    roof, roof_n = [], max(n, 64 * 2**20)
    for _ in range(args.rounds):
        roof += _roofline(roof_n, args.repeats)
        for r in runners:
            if r.error is None:
                r.time(args.repeats)
    # Median for the table; the best sample too, since on a shared machine other processes only ever slow
    # a sample down (the best is the closest to what the hardware does).
    roofline = 12 * roof_n / statistics.median(roof) / 1e9
    roofline_best = 12 * roof_n / min(roof) / 1e9
    rows = _rows(runners, n, roofline, roofline_best)
    _check_agreement(runners)
    _print(rows, n, args, roofline, roofline_best)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = dict(params=n, threads=args.threads, rounds=args.rounds, repeats=args.repeats,
                    roofline_gbps=roofline, roofline_best_gbps=roofline_best, simd=simd_level(),
                    torch=torch.__version__, cpu=platform.processor(), bytes_per_param=BYTES_PER_PARAM,
                    load_average=os.getloadavg())
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


def _rows(runners, n, roofline, roofline_best):
    ours = next(r for r in runners if r.name == "pyparallel CPUAdam")
    ours_ms = statistics.median(ours.times) * 1e3 if ours.times else None
    ours_best = min(ours.times) * 1e3 if ours.times else None
    rows = []
    for r in runners:
        if r.error is not None:
            rows.append(dict(name=r.name, error=r.error))
            continue
        ms, best = statistics.median(r.times) * 1e3, min(r.times) * 1e3
        gbps, gbps_best = (BYTES_PER_PARAM * n / (t / 1e3) / 1e9 for t in (ms, best))
        rows.append(dict(name=r.name, ms=ms, gbps=gbps, roofline_frac=gbps / roofline, best_ms=best,
                         best_gbps=gbps_best, best_roofline_frac=gbps_best / roofline_best,
                         ours_speedup=(ms / ours_ms) if ours_ms else None,
                         ours_speedup_best=(best / ours_best) if ours_best else None, samples=len(r.times)))
    return rows


def _check_agreement(runners):
    """Every contender ran the same number of steps on the same data: their params must agree."""
    done = [r for r in runners if r.error is None]
    base = done[0].param.detach()
    for r in done[1:]:
        diff = (r.param.detach() - base).abs().max().item()
        if diff > 1e-5:
            print(f"WARNING: {r.name} differs from {done[0].name} by {diff:.2e} after the same steps")


def _print(rows, n, args, roofline, roofline_best):
    print(f"\nCPU Adam step, {n / 1e6:.0f}M fp32 params, {args.threads} threads, SIMD {simd_level()}; "
          f"{BYTES_PER_PARAM} B/param; roofline a.add_(b) {roofline:.1f} GB/s median, {roofline_best:.1f} best; "
          f"{args.rounds}x{args.repeats} alternating steps; load average {os.getloadavg()[0]:.1f}")
    print(f"{'optimizer':32s} {'median ms':>9s} {'GB/s':>6s} {'roof':>5s} {'speedup':>8s} | {'best ms':>8s} "
          f"{'GB/s':>6s} {'roof':>5s} {'speedup':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:32s} {'failed: ' + r['error']}")
            continue
        print(f"{r['name']:32s} {r['ms']:9.1f} {r['gbps']:6.1f} {100 * r['roofline_frac']:4.0f}% "
              f"{r['ours_speedup']:7.2f}x | {r['best_ms']:8.1f} {r['best_gbps']:6.1f} "
              f"{100 * r['best_roofline_frac']:4.0f}% {r['ours_speedup_best']:7.2f}x")
    print("speedup = that row's time / pyparallel CPUAdam's (how many times faster CPUAdam is); the bf16 "
          "rows also write 2 B/param more than the 28 counted")


if __name__ == "__main__":
    main()
