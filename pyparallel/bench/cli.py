"""``pyparallel bench``: every strategy side by side on this machine, measured against the planner's
prediction and (``--peers``) against PyTorch's own implementations. See docs/bench.md.

Exit status: 0 when every row ran and matches the single-process reference; 1 when a row could not be
built or does not match (a correctness problem, never a matter of speed); 2 for bad input (an unknown
strategy name, a layout that does not fit the process count or the model, a strategy this install cannot
run).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from pyparallel.bench import specs as S


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyparallel bench", description=__doc__.splitlines()[0].strip("`"))
    p.add_argument("--nprocs", type=int, default=2, help="processes to spawn (default 2; 4 adds DP×TP, DP×PP, "
                   "TP×PP layouts)")
    p.add_argument("--strategies", default=None, help="comma-separated names (default: all that fit); "
                   "--list shows them")
    p.add_argument("--peers", action="store_true", help="add PyTorch DDP, ZeroRedundancyOptimizer, FSDP2, "
                   "DTensor TP and torch.distributed.pipelining rows, each with its ratio to ours")
    p.add_argument("--list", action="store_true", help="print the known strategy names and exit")
    p.add_argument("--model", default="small-test", help="built-in GPT preset (default small-test)")
    p.add_argument("--layers", type=int, help="override the preset's n_layer")
    p.add_argument("--hidden", type=int, help="override the preset's n_embd")
    p.add_argument("--heads", type=int, help="override the preset's n_head")
    p.add_argument("--vocab", type=int, help="override the preset's vocab_size")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's block size)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per strategy (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per pipeline step (default 4)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: bf16 weights and compute with fp32 master weights, optimizer state and reductions, "
                   "for the ZeRO rows and DeepSpeed's (the reference stays fp32; default fp32)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda (NCCL) when there is a GPU per process, else cpu (gloo)")
    p.add_argument("--cluster", default=None, help="the planner's hardware preset for predicted step times "
                   "(default: cpu on CPUs, h100 on GPUs; see pyparallel plan --help)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the whole run is stopped")
    p.add_argument("--json", metavar="FILE", help="write every row as JSON")
    p.add_argument("--md", metavar="FILE", help="write the table as Markdown")
    p.add_argument("--plot", metavar="FILE.png", help="plot step time and memory (measured vs predicted)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _config(args, strategies, device, cluster="cpu"):
    from pyparallel.bench.adapter import Hyper
    from pyparallel.bench.runner import BenchConfig

    overrides = {k: v for k, v in (("n_layer", args.layers), ("n_embd", args.hidden), ("n_head", args.heads),
                                   ("vocab_size", args.vocab)) if v is not None}
    probe = BenchConfig(model=args.model, overrides=overrides)
    cfg = probe.gpt()
    seq = args.seq or cfg.block_size
    if seq > cfg.block_size:
        raise ValueError(f"--seq {seq} exceeds the model's block size {cfg.block_size}")
    return BenchConfig(nprocs=args.nprocs, model=args.model, overrides=overrides, batch=args.batch, seq=seq,
                       steps=args.steps, warmup=args.warmup, microbatches=args.microbatches, device=device,
                       cluster=cluster, strategies=tuple(strategies), hp=Hyper(dtype=args.dtype))


def _select(args, cfg) -> tuple[list, list[str]]:
    """The specs to run (reference first) and notes on defaults left out. Raises StrategyError."""
    from pyparallel.bench.strategies import unavailable

    chosen = S.parse(args.strategies, args.nprocs, peers=args.peers)
    explicit = set(args.strategies.split(",")) if args.strategies else set()
    keep, notes = [], []
    for spec in chosen:
        why = (S.misfit(spec, cfg, args.batch, args.microbatches) or S.dtype_misfit(spec, args.dtype)
               or unavailable(spec))
        if why is None:
            keep.append(spec)
        elif spec.name in explicit:
            raise S.StrategyError(f"strategy {spec.name!r} cannot run: {why}")
        else:
            notes.append(f"{spec.name}: left out ({why})")
    return keep, notes


def _hardware(args) -> tuple[str, str]:
    """(device, the planner's cluster preset for predicted step times)."""
    from pyparallel.planner import resolve_cluster

    device = _device(args.device, args.nprocs)
    cluster = args.cluster or ("cpu" if device == "cpu" else "h100")
    resolve_cluster(cluster)
    return device, cluster


def _device(choice: str, nprocs: int) -> str:
    """NCCL needs a GPU per process; ``auto`` falls back to gloo on the CPUs when there are fewer."""
    from pyparallel import device

    gpus = device.cuda_device_count()
    if choice == "cuda" and gpus < nprocs:
        raise ValueError(f"--device cuda needs a GPU per process: {nprocs} processes, {gpus} GPUs visible; "
                         f"use --nprocs {gpus} or --device cpu" if gpus else "--device cuda: no GPU visible")
    if choice != "auto":
        return choice
    return "cuda" if gpus >= nprocs else "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if args.nprocs < 1:
        print(f"pyparallel bench: --nprocs must be at least 1, got {args.nprocs}", file=sys.stderr)
        return 2
    if args.list:
        for name, spec in S.known(args.nprocs).items():
            print(f"{name:20s} dp={spec.dp} tp={spec.tp} pp={spec.pp}  {spec.note}")
        return 0
    for name, least in (("batch", 1), ("steps", 1), ("microbatches", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            print(f"pyparallel bench: --{name} must be at least {least}, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    try:
        config = _config(args, (), "cpu")
        specs, notes = _select(args, config.gpt())
    except (S.StrategyError, ValueError) as exc:
        print(f"pyparallel bench: {exc}", file=sys.stderr)
        return 2
    reference = S.named(1)["single"]
    hide_reference = all(s.name != "single" for s in specs)
    specs = [reference] + [s for s in specs if s.name != "single"]
    try:
        device, cluster = _hardware(args)
    except ValueError as exc:  # PlanError is a ValueError too
        print(f"pyparallel bench: {exc}", file=sys.stderr)
        return 2
    config = _config(args, specs, device, cluster)
    return _run(config, args, notes, hide_reference, argv)


def _run(config, args, notes, hide_reference, argv) -> int:
    import torch

    from pyparallel.bench import report, results, runner

    t0 = time.perf_counter()
    per_rank = runner.launch(config, show_progress=not args.no_progress, timeout_s=args.timeout)
    rows = results.build_rows(list(config.strategies), per_rank, config, on_cpu=config.device == "cpu")
    if hide_reference:
        rows = [r for r in rows if r["strategy"] != "single"]
    elapsed = time.perf_counter() - t0
    meta = {"model": config.model, "overrides": config.overrides, "nprocs": config.nprocs,
            "device": config.device, "cluster": config.cluster, "batch": config.batch, "seq": config.seq,
            "steps": config.steps, "warmup": config.warmup, "microbatches": config.microbatches,
            "dtype": config.hp.dtype, "torch": torch.__version__,
            "command": "pyparallel bench " + shlex.join(argv), "elapsed_s": round(elapsed, 2), "notes": notes}
    print(report.table(rows))
    for note in notes:
        print(f"note: {note}")
    print(f"({config.nprocs} processes on {config.device}, {elapsed:.1f} s)")
    if args.json:
        report.write_json(args.json, rows, meta)
    if args.md:
        report.write_md(args.md, rows, meta)
    if args.plot:
        report.write_png(args.plot, rows, meta)
    failed = [r["strategy"] for r in rows if r.get("skipped")]
    bad = [r["strategy"] for r in rows if not r.get("skipped") and not r["matches_reference"]]
    if failed:
        print(f"pyparallel bench: could not build {', '.join(failed)} (see the table)", file=sys.stderr)
    if bad:
        print(f"pyparallel bench: losses differ from the single-process reference for {', '.join(bad)}",
              file=sys.stderr)
    return 1 if failed or bad else 0
