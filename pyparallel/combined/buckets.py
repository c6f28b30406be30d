"""The flat groups (gradient buckets) of a pipeline stage for the one sharded engine, and, for ZeRO-2 with
several pipeline chunks per rank, which groups each chunk's reduction rounds reduce.

``pyparallel.parallelize`` builds them once per stage (docs/pipeline.md, "ZeRO-2 keeps no full gradient").
"""

from __future__ import annotations

from pyparallel.pipeline_parallel import schedules
from pyparallel.pipeline_parallel.schedules import SPLIT_BACKWARD
from pyparallel.zero import groups as groups_mod
from pyparallel.zero.flat_param import FlatLayout


def stage_layouts(named, tie_groups, world: int, cap_bytes: int, elem: int, group_of: dict, n_groups: int,
             users: dict[int, frozenset] | None = None):
    """This stage's flat groups: each cross-stage tied weight alone (the same layout on every stage holding
    it), then gradient buckets of the rest, each ordered by parameter group. ``users``: id(parameter) -> the
    local pipeline chunks holding it, when a bucket must not mix chunks (ZeRO-2 with several chunks per rank,
    ``round_plan``): the buckets are then formed per set of chunks, each chunk's own first (in chunk order),
    then those of parameters two chunks share (ZBV's tied embedding and head, both on rank 0)."""
    trainable = [(info.name, p) for info, p in named if p.requires_grad]
    if not trainable:
        raise ValueError("this pipeline stage has no trainable parameters: nothing to optimize")
    tied = [(n, p) for n, p in trainable if id(p) in tie_groups]
    rest = [(n, p) for n, p in trainable if id(p) not in tie_groups]
    # split: the stages holding a tied weight each update a part of every slice (ShardEngine)
    layouts = [FlatLayout([n], [p], world, split=tie_groups[id(p)].size) for n, p in tied]
    ties = [(g, tie_groups[id(p)]) for g, (_, p) in enumerate(tied)]
    if users is None:
        sets = [rest] if rest else []
    else:
        keys = sorted({users[id(p)] for _, p in rest}, key=lambda k: (len(k), sorted(k)))
        sets = [[(n, p) for n, p in rest if users[id(p)] == k] for k in keys]
    for part in sets:
        layouts += groups_mod.grouped_buckets(part, cap_bytes, world, elem, group_of, n_groups)
    return layouts, ties


def chunk_users(pipe) -> dict[int, frozenset]:
    """id(parameter) -> the local pipeline chunks that hold it."""
    out: dict[int, set] = {}
    for c, chunk in pipe.chunks.items():
        for p in chunk.parameters():
            out.setdefault(id(p), set()).add(c)
    return {k: frozenset(v) for k, v in out.items()}


def round_plan(pipe, layouts, users: dict[int, frozenset], schedule: str) -> dict[int, list[int]]:
    """ZeRO-2 with several chunks per rank: local chunk -> the flat groups its reduction rounds reduce
    (``zero.rounds`` ``_open_round``). A group of one chunk's parameters is reduced by that chunk's rounds; a
    group whose parameters several local chunks hold (each group holds parameters of one set of chunks,
    ``stage_layouts``) by the rounds of the one among them whose round comes last in the action list, so its
    last round finds every micro-batch's gradients in (a round reduces what its groups have accumulated;
    the other chunks' rounds leave it there). A round is a W, or a backward when it is not split (no
    zero-bubble schedule, or a checkpointed chunk). So each group is reduce-scattered once per micro-batch:
    one pass over the stage's gradient per micro-batch, as with one chunk per rank."""
    split_w = schedule in SPLIT_BACKWARD
    actions = schedules.build(schedule, pipe.rank, pipe.p, pipe.num_microbatches, pipe.v)
    last: dict[int, int] = {}  # chunk -> position of its last round in the list
    for pos, a in enumerate(actions):
        ckpt = pipe.chunks[a.chunk].activation_checkpointing
        if a.kind == ("W" if split_w and not ckpt else "B"):
            last[a.chunk] = pos
    trained = sorted({c for lay in layouts for p in lay.params for c in users[id(p)]})
    rounds: dict[int, list[int]] = {c: [] for c in trained}
    for g, lay in enumerate(layouts):
        holders = set().union(*(users[id(p)] for p in lay.params))
        rounds[max(holders, key=lambda c: last[c])].append(g)
    return rounds
