"""The zero-bubble B/W split of one pipeline chunk against its full backward, in one process.

A chunk of the bench GPT's layers (the hidden states in, the loss of a head on top or a random output
gradient) runs, alternating per iteration:

* **full**: ``torch.autograd.backward`` (what 1F1B runs);
* **split**: ``split.backward_input`` (B: the input gradient only) then ``WeightPass.run`` (W), with
  W's one-node Linear / LayerNorm groups evaluated directly (``split.py``, "Direct W");
* **split, engine W**: the same B, with every W group through an autograd call (the direct path off), as
  before the direct path existed;
* **split, Python analysis**: B's graph analysis and capture hooks in Python (``split._analyse``), as
  without the extension, instead of ``pyparallel._C.split_plan``.

Reports medians of B, W and B + W, and B + W over the full backward: what splitting costs a stage.

    python benchmarks/split_backward.py --layers 4
    python benchmarks/split_backward.py --layers 2 --head
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, table, write_json  # noqa: E402

from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch  # noqa: E402
from pyparallel.pipeline_parallel import split as split_module  # noqa: E402
from pyparallel.pipeline_parallel import to_blocks, token_cross_entropy  # noqa: E402
from pyparallel.pipeline_parallel.split import backward_input, param_nodes_of  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--layers", type=int, default=4, help="layers in the chunk")
    ap.add_argument("--head", action="store_true", help="end the chunk with the final norm, head and loss")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="micro-batch size")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default="benchmarks/out/split_backward.json")
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    cfg = gpt_config(a.preset, n_layer=a.layers + 1, vocab_size=a.vocab, tie_embeddings=False)
    blocks, _ = to_blocks(GPT(cfg, seed=0))  # [embedding, layer 0..n, head]
    chunk = nn.Sequential(*blocks[2:2 + a.layers], *(blocks[-1:] if a.head else []))
    params = list(chunk.parameters())
    nodes = param_nodes_of(params)
    idx, tgt = synthetic_batch(cfg, a.batch, a.seq, seed=0)
    with torch.no_grad():
        hidden = nn.Sequential(*blocks[:2])(idx)

    def forward():
        x = hidden.clone().requires_grad_(True)
        y = chunk(x)
        if a.head:
            return x, token_cross_entropy(y, tgt), None
        return x, y, torch.ones_like(y)

    def full():
        _x, y, g = forward()
        start = time.perf_counter()
        torch.autograd.backward(y, g)
        return time.perf_counter() - start, None

    native = split_module._native

    def split(direct: bool, python_analysis: bool = False):
        x, y, g = forward()
        split_module._native = (lambda: None) if python_analysis else native
        start = time.perf_counter()
        _gx, wpass = backward_input(y, g, x, params, nodes)
        if not direct:
            for group in wpass._groups:
                group.direct = None
        mid = time.perf_counter()
        wpass.run()
        end = time.perf_counter()
        return end - start, (mid - start, end - mid)

    runs = {"full": full, "split": lambda: split(True), "split, engine W": lambda: split(False)}
    if native() is not None:
        runs["split, Python analysis"] = lambda: split(True, python_analysis=True)
    times = {k: [] for k in runs}
    parts = {k: [] for k in runs}
    names = list(runs)
    for it in range(a.warmup + a.iters):
        k = it % len(names)
        for name in names[k:] + names[:k]:  # rotating order
            total, bw = runs[name]()
            if it >= a.warmup:
                times[name].append(total)
                parts[name].append(bw)
            chunk.zero_grad(set_to_none=False)
    base = median(times["full"])
    rows = []
    for name in names:
        b = median([p[0] for p in parts[name]]) * 1e3 if parts[name][0] else None
        w = median([p[1] for p in parts[name]]) * 1e3 if parts[name][0] else None
        rows.append({"backward": name, "B ms": b, "W ms": w, "total ms": median(times[name]) * 1e3,
                     "/ full": median(times[name]) / base})
    print(f"GPT preset {a.preset!r}: {a.layers} layers{' + head and loss' if a.head else ''}, micro-batch "
          f"{a.batch} x {a.seq}, {torch.get_num_threads()} thread(s), {a.iters} alternating iterations, medians")
    print(table(rows, list(rows[0])))
    write_json(a.json, {"config": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
