"""The bench's worker: every strategy of one run inside one launch of N processes.

Spawning and initialising processes costs seconds, so the worker loops over the strategies itself:
for each it builds a fresh mesh (``pyparallel.init`` may be called again once torch.distributed is up)
and a fresh model, runs the same global batches (made from the seed on every rank), and records per
step the wall time, this rank's loss and the bytes ``pyparallel.comm`` counted. A barrier separates
steps so every rank starts a step together; it and the loss bookkeeping stay outside the counted window.

The single-process reference (the ``single`` row) runs first, on every rank at once on the whole batch:
each rank keeps one core busy, as in every other row, and the parent reads its losses from any rank.
On a CPU, peak memory is measured in a pass of its own over the warm-up steps (see :func:`worker`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from pyparallel.bench.specs import StrategySpec
from pyparallel.bench.strategies import Hyper


@dataclass(frozen=True)
class BenchConfig:
    nprocs: int = 2
    model: str = "small-test"
    overrides: dict = field(default_factory=dict)  # GPTConfig fields (tests shrink the model)
    batch: int = 8  # global batch, sequences
    seq: int = 128
    steps: int = 8  # timed steps
    warmup: int = 2  # steps run (and checked against the reference) but not timed
    microbatches: int = 4  # per pipeline step
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL)
    cluster: str = "cpu"  # the planner's hardware preset for the predicted step time
    hp: Hyper = field(default_factory=Hyper)
    strategies: tuple[StrategySpec, ...] = ()

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def gpt(self):
        from pyparallel.models.gpt import gpt_config

        return gpt_config(self.model, **self.overrides)


def sent_bytes(stats: dict) -> int:
    """Bytes this rank put on the wire: ``comm_stats`` wire bytes less what it received point to point
    (comm counts a received tensor too; the planner, like nccl-tests, counts what a rank sends)."""
    recv = stats["by_op"].get("recv", {}).get("wire_bytes", 0)
    return stats["total"]["wire_bytes"] - recv


def sent_by_axis(stats: dict) -> dict:
    out: dict[str, int] = {}
    for key, leaf in stats["by_op_axis"].items():
        op, axis = key.split("@", 1)
        if op != "recv":
            out[axis] = out.get(axis, 0) + leaf["wire_bytes"]
    return out


def _batches(config: BenchConfig, cfg, dev):
    from pyparallel.models.gpt import synthetic_batch

    out = []
    for step in range(config.total_steps):
        idx, tgt = synthetic_batch(cfg, config.batch, config.seq, seed=1000 + step)
        out.append((idx.to(dev), tgt.to(dev)))
    return out


def _warm_up(cfg, dev, config) -> None:
    """One throwaway step so lazily loaded kernels and libraries do not land in the first row's memory.

    With ``--dtype bf16`` a second one in bf16 at a rank's own batch shape: the CPU's bf16 kernels (oneDNN)
    generate their code and scratch buffers per shape on first use, ~15 MB on the bench's small model,
    which would otherwise count in the first bf16 row's peak only."""
    from pyparallel.models.gpt import GPT, synthetic_batch

    model = GPT(cfg, seed=0).to(dev)
    idx, tgt = synthetic_batch(cfg, 2, 8, seed=0)
    model(idx.to(dev), tgt.to(dev)).backward()
    torch.optim.AdamW(model.parameters()).step()
    if config.hp.dtype == "bf16":
        model = model.to(torch.bfloat16)
        idx, tgt = synthetic_batch(cfg, max(1, config.batch // config.nprocs), config.seq, seed=0)
        model(idx.to(dev), tgt.to(dev)).backward()


def _build(spec, base, cfg, config):
    """Build on every rank; agree on success with one object all-gather so that a strategy that cannot be
    built is skipped everywhere with its error in the row (validation errors come before any collective,
    on every rank alike; an error after a collective on some ranks only ends in the collective timeout)."""
    import pyparallel
    from pyparallel import comm
    from pyparallel.bench import strategies

    adapter, error = None, None
    try:
        mesh = base if spec.world == 1 else pyparallel.init(dp=spec.dp, tp=spec.tp, pp=spec.pp)
        adapter = strategies.build(spec, mesh, cfg, config.hp, config.microbatches)
    except Exception as exc:  # noqa: BLE001 (reported in the row; every rank agrees below)
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    errors = [e for e in comm.all_gather_object(error, base.world_group) if e]
    return (None, errors[0]) if errors else (adapter, None)


def two_passes(config: BenchConfig) -> bool:
    """On a CPU with warm-up steps, memory is measured in a pass of its own (see :func:`worker`)."""
    return config.device == "cpu" and config.warmup > 0


class _Run:
    """One strategy being measured: its adapter and the record its steps fill in."""

    def __init__(self, spec: StrategySpec, base, cfg, config: BenchConfig, memory: bool):
        from pyparallel.bench import measure

        self.spec, self.memory = spec, memory
        self.peak = measure.PeakMemory(base.device)
        if memory:
            self.peak.baseline()
        self.t0 = time.perf_counter()
        self.adapter, error = _build(spec, base, cfg, config)
        self.record = {"strategy": spec.name, "rank": base.rank, "skipped": error,
                       "build_s": time.perf_counter() - self.t0}
        if self.adapter is None:
            return
        mesh, single = self.adapter.mesh, spec.world == 1  # the reference runs whole on every rank: "replica 0"
        self.record["coords"] = {"dp": 0 if single else mesh.dp_rank, "tp": 0 if single else mesh.tp_rank,
                                 "pp": 0 if single else mesh.pp_rank}
        self.times, self.losses, self.wire, self.by_axis = [], [], [], {}
        if memory:
            self.peak.start()

    def step(self, i: int, idx, tgt, base, config: BenchConfig) -> None:
        import pyparallel
        from pyparallel import comm
        from pyparallel.bench import measure

        if i == config.warmup:
            self.adapter.timing_starts()
        comm.barrier(base.world_group)
        pyparallel.reset_comm_stats()
        with measure.StepTimer(base.device) as timer:
            loss = self.adapter.step(idx, tgt)
        stats = pyparallel.comm_stats()
        self.losses.append(None if loss is None else float(loss))
        if i >= config.warmup:
            self.times.append(timer.seconds)
            self.wire.append(sent_bytes(stats))
            self.by_axis = sent_by_axis(stats)

    def finish(self) -> dict:
        from pyparallel.bench import measure

        if self.adapter is not None:
            self.record.update(times=self.times, losses=self.losses, wire_bytes=self.wire,
                               wire_by_axis=self.by_axis, stats=self.adapter.stats())
            if self.memory:
                self.record.update(peak_bytes=self.peak.peak_bytes(), states=self.adapter.model_states())
            self.adapter = None
            measure.settle()
        self.record["wall_s"] = time.perf_counter() - self.t0
        return self.record


def run_strategy(spec: StrategySpec, base, cfg, config: BenchConfig, batches, progress, *,
                 memory: bool = True) -> dict:
    """Build ``spec``, run ``batches`` and record what they show. ``memory``: measure the peak over these
    steps (from a baseline taken before the build) and the model states after them."""
    return run_alternating([spec], base, cfg, config, batches, progress, memory=memory)[0]


def run_alternating(specs: list[StrategySpec], base, cfg, config: BenchConfig, batches, progress, *,
                    memory: bool = False) -> list[dict]:
    """Build every strategy of ``specs`` and step them in turn on each batch, rotating which goes first, so
    that drifts in machine load (other jobs, frequency, heat) fall on all of them alike and the ratios of
    their step times can be quoted. One record per spec, in order."""
    runs = [_Run(spec, base, cfg, config, memory) for spec in specs]
    live = [r for r in runs if r.adapter is not None]
    for r in runs:
        if r.adapter is None:
            progress(r.spec.name, len(batches))
    for i, (idx, tgt) in enumerate(batches):
        k = i % max(len(live), 1)
        for r in live[k:] + live[:k]:
            r.step(i, idx, tgt, base, config)
            progress(r.spec.name, 1)
    return [r.finish() for r in runs]


def timing_groups(specs) -> list[list[StrategySpec]]:
    """Each of our strategies with the peers (PyTorch, DeepSpeed) measured against it (alternating, see
    :func:`run_alternating`); any other strategy alone. In the order of ``specs``."""
    peers: dict[str, list[StrategySpec]] = {}
    for s in specs:
        if s.is_peer:
            peers.setdefault(s.peer_of, []).append(s)
    ours = {s.name for s in specs if not s.is_peer}
    groups = []
    for s in specs:
        if not s.is_peer:
            groups.append([s] + peers.get(s.name, []))
        elif s.peer_of not in ours:  # its counterpart was not asked for: measured alone
            groups.append([s])
    return groups


def worker(config: BenchConfig, queue=None) -> list[dict]:
    """Runs on every rank: the strategies in order, one record each.

    On a CPU the resident-set peak needs glibc in precise mode, which slows every step by its page faults
    and, once fast mode has run, stays disturbed by the heap fast mode leaves behind. So with warm-up
    steps there are two passes: first every strategy's warm-up steps in precise mode (peak memory and
    model states), then every strategy again from scratch in fast mode (losses, times, traffic, bubble),
    where each of our strategies runs alternately with its PyTorch peers (``--peers``). Without the
    memory pass (a GPU, or no warm-up) strategies run one after another, so peers' ratios are sequential.
    """
    import pyparallel
    from pyparallel.bench import deepspeed_peers, measure

    # Before any tensor exists. A GPU's allocator reports its own peak: host memory can stay in fast mode.
    if config.device == "cpu":
        measure.precise_mode()
    else:
        measure.fast_mode()
    backend = "nccl" if config.device == "cuda" else "gloo"
    base = pyparallel.init(backend=backend)
    cfg = config.gpt()
    dev = base.device
    if any(s.name in deepspeed_peers.ROWS for s in config.strategies):
        deepspeed_peers.preload(backend)
    _warm_up(cfg, dev, config)
    batches = _batches(config, cfg, dev)

    def progress(name, n):
        if queue is not None and base.rank == 0:
            queue.put((name, n))

    specs = config.strategies
    if not two_passes(config):
        return [run_strategy(spec, base, cfg, config, batches, progress) for spec in specs]
    memory = {spec.name: run_strategy(spec, base, cfg, config, batches[:config.warmup], progress)
              for spec in specs}
    measure.fast_mode()
    timed = {}
    for group in timing_groups(specs):
        for spec, rec in zip(group, run_alternating(group, base, cfg, config, batches, progress)):
            timed[spec.name] = rec
    out = []
    for spec in specs:
        rec, mem = timed[spec.name], memory[spec.name]
        if not rec["skipped"]:
            rec.update(peak_bytes=mem.get("peak_bytes"), states=mem.get("states"))
        out.append(rec)
    return out


def launch(config: BenchConfig, show_progress: bool = True, timeout_s: float | None = None) -> list[list[dict]]:
    """Spawn ``config.nprocs`` processes (OMP_NUM_THREADS=1 each), run :func:`worker`, return records per
    rank. A tqdm bar on stderr follows rank 0's steps."""
    import multiprocessing as mp

    import pyparallel

    ctx = mp.get_context("spawn")
    queue = ctx.Queue() if show_progress else None
    thread = None
    if queue is not None:
        per = config.total_steps + (config.warmup if two_passes(config) else 0)
        thread = threading.Thread(target=_follow, args=(queue, len(config.strategies) * per), daemon=True)
        thread.start()
    try:
        return pyparallel.launch(worker, config.nprocs, (config, queue), env={"OMP_NUM_THREADS": "1"},
                                 timeout_s=timeout_s)
    finally:
        if queue is not None:
            queue.put(None)
            thread.join(timeout=5)


def _follow(queue, total: int) -> None:
    from tqdm import tqdm

    with tqdm(total=total, desc="bench", unit="step", dynamic_ncols=True, leave=False) as bar:
        while True:
            item = queue.get()
            if item is None:
                break
            name, n = item
            bar.set_description(f"bench {name}")
            bar.update(n)
