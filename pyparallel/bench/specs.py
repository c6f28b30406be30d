"""Strategy names for ``pyparallel bench``: what each short name means, which fit a world size and a model,
and which the default run picks.

Names are short and stable (they are the keys of the JSON rows): ``single``, ``ddp``, ``zero1``,
``zero2``, ``zero3``, ``zero3-offload``, ``tp``, ``pp-gpipe``, ``pp-1f1b``, ``pp-interleaved``,
``pp-zb-h1``, ``pp-zbv`` (zero bubble, Qi et al. 2023), layouts
such as ``dp2xtp2``, ``dp2xpp2``, ``tp2xpp2``, ``dp2xtp2xpp2`` (degrees multiply to the world size; plain
data parallelism on dp), the same with a ZeRO stage on dp (``dp2xtp2-zero3``: ``pyparallel.parallelize``),
and the peers added by ``--peers``: PyTorch's ``torch-*`` and DeepSpeed's ``deepspeed-*``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StrategySpec:
    """One row of the bench: a dp × tp × pp layout, the ZeRO stage on the dp axis, the pipeline schedule.

    ``peer_of`` names the pyparallel strategy a peer (PyTorch, DeepSpeed) is compared with (``None`` for our own).
    """

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # 0: plain data parallel (DDP) over dp
    offload: bool = False
    schedule: str = "1f1b"
    virtual: int = 1  # model chunks per pipeline rank (interleaved and zbv schedules)
    peer_of: str | None = None
    note: str = ""

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def is_peer(self) -> bool:
        return self.peer_of is not None

    @property
    def planner_strategy(self) -> str:
        """The planner's name for the data-parallel part: 'ddp', 'zero1', 'zero2' or 'zero3'."""
        return "ddp" if self.zero == 0 else f"zero{self.zero}"


class StrategyError(ValueError):
    """A strategy name the bench does not know, or one that does not fit the world size or the model."""


_PP_SCHEDULES = {"pp-gpipe": "gpipe", "pp-1f1b": "1f1b", "pp-interleaved": "interleaved", "pp-zb-h1": "zb-h1",
                 "pp-zbv": "zbv"}
_TWO_CHUNKS = ("interleaved", "zbv")  # schedules with 2 model chunks per pipeline rank in the bench
_LAYOUT = re.compile(r"^(?:dp(\d+))?(?:x?tp(\d+))?(?:x?pp(\d+))?(?:-zero[0-3])?$")

# PyTorch's own implementations, each against the pyparallel strategy a user would otherwise compare.
PEERS = {
    "torch-ddp": ("ddp", "torch.nn.parallel.DistributedDataParallel"),
    "torch-zero1": ("zero1", "DDP + torch.distributed.optim.ZeroRedundancyOptimizer"),
    "torch-fsdp2-zero2": ("zero2", "FSDP2 fully_shard per block, reshard_after_forward=False"),
    "torch-fsdp2": ("zero3", "FSDP2 fully_shard per block"),
    "torch-tp": ("tp", "DTensor parallelize_module, ColwiseParallel/RowwiseParallel"),
    "torch-pp-1f1b": ("pp-1f1b", "torch.distributed.pipelining Schedule1F1B"),
}
# DeepSpeed's ZeRO engine (pyparallel/bench/deepspeed_peers.py), added by --peers whenever deepspeed imports.
DEEPSPEED_PEERS = {
    "deepspeed-zero1": ("zero1", "deepspeed.initialize, ZeRO stage 1"),
    "deepspeed-zero2": ("zero2", "deepspeed.initialize, ZeRO stage 2"),
    "deepspeed-zero3": ("zero3", "deepspeed.initialize, ZeRO stage 3"),
    "deepspeed-zero3-offload": ("zero3-offload", "deepspeed.initialize, ZeRO stage 3, offload_optimizer cpu, "
                                                 "DeepSpeedCPUAdam"),
}
# Two-axis peers: torchtitan's layout, FSDP2 over a DTensor-TP model on a 2-D DeviceMesh (dp x tp=2).
PEERS_2D = {"torch-fsdp2xtp": "FSDP2 fully_shard over DTensor TP (ColwiseParallel/RowwiseParallel), 2-D DeviceMesh"}


# The rows ``--dtype bf16`` runs (mixed precision with fp32 master weights and reductions); the reference
# (``single``) stays fp32 and the other rows have no bf16 mode in the bench.
BF16_ROWS = ("zero1", "zero2", "zero3", "zero3-offload", *DEEPSPEED_PEERS)


def dtype_misfit(spec: StrategySpec, dtype: str) -> str | None:
    """Why ``spec`` does not run at ``dtype``, or None."""
    if dtype == "fp32" or spec.name == "single" or spec.name in BF16_ROWS:
        return None
    return f"--dtype {dtype} runs only {', '.join(BF16_ROWS)}; {spec.name} has no {dtype} mode in the bench"


def named(world: int) -> dict[str, StrategySpec]:
    """Every fixed name at this world size (the single-axis strategies use the whole world)."""
    n = world
    out = {"single": StrategySpec("single", note="one process, whole batch: the reference")}
    if n >= 2:
        out["ddp"] = StrategySpec("ddp", dp=n, note="pyparallel.DataParallel")
        for stage in (1, 2, 3):
            out[f"zero{stage}"] = StrategySpec(f"zero{stage}", dp=n, zero=stage,
                                               note=f"pyparallel.zero.setup(stage={stage})")
        out["zero3-offload"] = StrategySpec("zero3-offload", dp=n, zero=3, offload=True,
                                            note="pyparallel.zero.setup(stage=3, offload_optimizer=True)")
        out["tp"] = StrategySpec("tp", tp=n, note="pyparallel.tensor_parallel.parallelize")
        for name, sched in _PP_SCHEDULES.items():
            out[name] = StrategySpec(name, pp=n, schedule=sched, virtual=2 if sched in _TWO_CHUNKS else 1,
                                     note=f"pyparallel.pipeline_parallel.PipelineParallel, {sched}")
        for peer, (ours, what) in {**PEERS, **DEEPSPEED_PEERS}.items():
            base = out[ours]
            out[peer] = StrategySpec(peer, dp=base.dp, tp=base.tp, pp=base.pp, zero=base.zero,
                                     offload=base.offload, schedule=base.schedule, peer_of=ours, note=what)
    return out


def layouts(world: int) -> dict[str, StrategySpec]:
    """Two- and three-axis layouts whose degrees (each ≥ 2) multiply to ``world``: DDP on dp, 1F1B on pp."""
    out = {}
    divs = [d for d in range(2, world + 1) if world % d == 0]
    for dp in [1, *divs]:
        for tp in [1, *divs]:
            if world % (dp * tp):
                continue
            pp = world // (dp * tp)
            if sum(d > 1 for d in (dp, tp, pp)) < 2:
                continue
            name = "x".join(f"{axis}{d}" for axis, d in (("dp", dp), ("tp", tp), ("pp", pp)) if d > 1)
            parts = [w for d, w in ((dp, "data parallel"), (tp, "tensor parallel"), (pp, "1F1B pipeline")) if d > 1]
            out[name] = StrategySpec(name, dp=dp, tp=tp, pp=pp, note=" × ".join(parts))
            if dp > 1:
                for stage in (1, 2, 3):
                    what = " × ".join(parts[1:] + [f"ZeRO-{stage}"])
                    zname = f"{name}-zero{stage}"
                    out[zname] = StrategySpec(zname, dp=dp, tp=tp, pp=pp, zero=stage,
                                              note=f"pyparallel.parallelize(zero_stage={stage}): {what}")
    # dp×tp, dp×pp, tp×pp, then three axes; by degrees within each
    order = sorted(out.values(), key=lambda s: (s.dp > 1 and s.tp > 1 and s.pp > 1, s.dp == 1, s.pp > 1,
                                                 -s.dp, -s.tp, s.zero))
    return {s.name: s for s in order}


def _peers_2d(world: int) -> dict[str, StrategySpec]:
    if world < 4 or world % 2:
        return {}
    ours = f"dp{world // 2}xtp2-zero3"
    return {name: StrategySpec(name, dp=world // 2, tp=2, zero=3, peer_of=ours, note=what)
            for name, what in PEERS_2D.items()}


def known(world: int) -> dict[str, StrategySpec]:
    return {**named(world), **layouts(world), **_peers_2d(world)}


def default_names(world: int) -> list[str]:
    """What a plain ``pyparallel bench`` runs: every strategy that fits the world size."""
    if world == 1:
        return ["single"]
    base = ["single", "ddp", "zero1", "zero2", "zero3", "zero3-offload", "tp", "pp-1f1b"]
    # Each layout with plain DP on its dp axis, and the two-axis layouts with ZeRO-3 there.
    extra = [n for n, s in layouts(world).items()
             if s.zero == 0 or (s.zero == 3 and (s.tp > 1) + (s.pp > 1) == 1)]
    return base + extra


def peer_names(world: int) -> list[str]:
    """What ``--peers`` adds: PyTorch's rows, torchtitan's 2-D row, DeepSpeed's rows (the command line leaves
    out, with the reason printed, those this machine cannot run)."""
    return (list(PEERS) + list(_peers_2d(world)) + list(DEEPSPEED_PEERS)) if world >= 2 else []


def parse(text: str | None, world: int, peers: bool = False) -> list[StrategySpec]:
    """``--strategies a,b,c`` (or the defaults) → specs, in the order given, without duplicates.

    Unknown names raise :class:`StrategyError` listing the known ones; a layout whose degrees do not
    multiply to the world size says so.
    """
    table = known(world)
    names = default_names(world) if not text else [t.strip() for t in text.split(",") if t.strip()]
    if peers:
        names += peer_names(world)
    out, seen = [], set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        if name not in table:
            raise StrategyError(_unknown_message(name, world, table))
        out.append(table[name])
    return out


def _unknown_message(name: str, world: int, table: dict) -> str:
    m = _LAYOUT.match(name)
    if m and any(m.groups()):
        degrees = [int(g) for g in m.groups() if g]
        prod = 1
        for d in degrees:
            prod *= d
        if prod != world:
            return (f"layout {name!r} needs {prod} processes but the bench runs {world} (--nprocs {world}); "
                    f"known names at this size: {', '.join(table)}")
    return f"unknown strategy {name!r}; known names with --nprocs {world}: {', '.join(table)}"


def misfit(spec: StrategySpec, cfg, batch: int, microbatches: int) -> str | None:
    """Why ``spec`` cannot run this model and batch (a reason naming the numbers), or None."""
    if batch % spec.dp:
        return f"the global batch {batch} is not divisible by dp={spec.dp}"
    if spec.tp > 1:
        for what, value in (("n_head", cfg.n_head), ("n_kv_head", cfg.kv_heads), ("n_embd", cfg.n_embd),
                            ("vocab_size", cfg.vocab_size)):
            if value % spec.tp:
                return f"tp={spec.tp} does not divide {what}={value}"
    if spec.pp > 1:
        chunks = spec.pp * spec.virtual
        if cfg.n_layer < chunks:
            return f"{cfg.n_layer} layers cannot fill {chunks} pipeline chunks"
        if spec.schedule == "interleaved" and cfg.n_layer % chunks:
            return f"the interleaved schedule needs n_layer={cfg.n_layer} divisible by pp×v={chunks}"
        local = batch // spec.dp
        if local % microbatches:
            return f"the per-replica batch {local} is not divisible by {microbatches} micro-batches"
        if microbatches < spec.pp:
            return f"{microbatches} micro-batches are fewer than the {spec.pp} pipeline stages"
    return None
