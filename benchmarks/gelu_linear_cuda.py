"""CUDA ``gelu_linear`` against eager ``F.gelu(z + b) @ w.T`` at real MLP shapes (run by gpu_check.sh).

Shapes: the second MLP matmul of GPT-2 XL (h=1600, 4h=6400) and LLaMA-7B (h=4096, ffn=11008), unsplit
(t=1) and as one rank of t=8, with M = b·s tokens. For each: max error of both against a float32
computation on the same inputs (forward and the three gradients), median forward and forward+backward
times (CUDA events, alternating), and the activation memory each keeps for backward. Writes JSON into
$OUT (or --json).

    python benchmarks/gelu_linear_cuda.py --iters 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pyparallel import _ops  # noqa: E402

SHAPES = {  # name: (M tokens, K = MLP width on this rank, N = hidden)
    "gpt2-xl t=1": (8192, 6400, 1600),
    "gpt2-xl t=8": (8192, 800, 1600),
    "llama-7b t=1": (4096, 11008, 4096),
    "llama-7b t=8": (4096, 1376, 4096),
}


def eager(z, b, w, approximate):
    return F.gelu(z + b, approximate=approximate) @ w.t()  # [M, K] @ [K, N]


def fused(z, b, w, approximate):
    return _ops.gelu_linear(z, b, w, approximate)


def _leaves(z, b, w):
    return [t.detach().clone().requires_grad_() for t in (z, b, w)]


def run_once(fn, z, b, w, g, approximate, backward=True):
    zl, bl, wl = _leaves(z, b, w)
    y = fn(zl, bl, wl, approximate)
    if backward:
        y.backward(g)
    return y, zl.grad, bl.grad, wl.grad


def timed(fn, args, iters):
    """Median milliseconds of fn(*args) over iters (after 3 warm-ups)."""
    out = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            out.append(start.elapsed_time(end))
    return statistics.median(out)


def kept_after_forward(fn, z, b, w, approximate):
    """Bytes allocated by a forward whose graph is kept alive (activations for backward + output)."""
    zl, bl, wl = _leaves(z, b, w)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fn(zl, bl, wl, approximate)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return kept


def bench_shape(name, m, k, n, dtype, iters, approximate):
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b = torch.randn(k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    g = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
    exact = run_once(eager, z.float(), b.float(), w.float(), g.float(), approximate)
    errs = {}
    for label, fn in (("eager", eager), ("fused", fused)):
        got = run_once(fn, z, b, w, g, approximate)
        errs[label] = [float((a.float() - e).abs().max()) for a, e in zip(got, exact)]
    ok = all(f <= 1.5 * e + 1e-3 * float(x.abs().max()) for f, e, x in zip(errs["fused"], errs["eager"], exact))
    del exact
    row = {"shape": name, "M,K,N": f"{m},{k},{n}", "dtype": str(dtype).split(".")[-1], "approximate": approximate,
           "max err fused [y,dz,db,dw]": errs["fused"], "max err eager": errs["eager"], "fused no worse": ok}
    for label, fn in (("eager", eager), ("fused", fused)):
        row[f"{label} fwd ms"] = timed(lambda fn=fn: run_once(fn, z, b, w, g, approximate, backward=False), (), iters)
        row[f"{label} fwd+bwd ms"] = timed(lambda fn=fn: run_once(fn, z, b, w, g, approximate), (), iters)
        row[f"{label} kept MiB"] = kept_after_forward(fn, z, b, w, approximate) / 2**20
    row["fwd speedup"] = row["eager fwd ms"] / row["fused fwd ms"]
    row["fwd+bwd speedup"] = row["eager fwd+bwd ms"] / row["fused fwd+bwd ms"]
    flops = 2 * m * k * n
    row["fused fwd TFLOP/s"] = flops / row["fused fwd ms"] / 1e9
    row["eager fwd TFLOP/s"] = flops / row["eager fwd ms"] / 1e9
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gelu_linear_cuda.py needs a CUDA device")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)}; "
          f"CUDA kernel registered: {_ops._gelu_linear_kernel(torch.device('cuda'))}")
    rows = []
    for name, (m, k, n) in SHAPES.items():
        for approximate in ("tanh", "none"):
            try:
                row = bench_shape(name, m, k, n, torch.bfloat16, a.iters, approximate)
            except Exception as exc:  # report and keep going: one failing shape must not hide the others
                row = {"shape": name, "approximate": approximate, "error": f"{type(exc).__name__}: {exc}"}
            rows.append(row)
            print(json.dumps(row))
            torch.cuda.empty_cache()
    cols = ["shape", "approximate", "eager fwd ms", "fused fwd ms", "fwd speedup", "eager fwd+bwd ms",
            "fused fwd+bwd ms", "fwd+bwd speedup", "eager kept MiB", "fused kept MiB", "fused no worse"]
    print("\n| " + " | ".join(cols) + " |")
    for r in rows:
        cells = [f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, r.get("error", "-"))) for c in cols]
        print("| " + " | ".join(cells) + " |")
    path = a.json or (os.path.join(os.environ["OUT"], "gelu_linear_cuda.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=2)
        print(f"wrote {path}")
    if any("error" in r or not r.get("fused no worse", False) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
