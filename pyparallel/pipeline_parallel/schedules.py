"""Pipeline schedules as plain action lists, one per stage, plus the message order they imply.

A schedule here is data, not code: for stage ``r`` it is the ordered list of :class:`Action` the stage
executes — ``F(chunk, mb)`` (forward of model chunk ``chunk`` on micro-batch ``mb``) or ``B(chunk, mb)``.
The runtime (``engine.py``) walks the list and derives every send and receive from it, so one executor
runs all three schedules and the schedules themselves are testable without processes.

* **GPipe** (Huang et al. 2019): every forward, then every backward. Keeps all ``m`` micro-batches of
  activations alive.
* **1F1B** (PipeDream-flush; Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"):
  stage ``r`` runs ``p - r - 1`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. Same bubble as GPipe, at most ``p - r`` micro-batches alive.
* **Interleaved 1F1B** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", section 2.2): each rank holds ``v`` model chunks (chunk ``c`` lives on rank
  ``c mod p``); micro-batches move through the chunks in groups of ``p``. The bubble time shrinks by ``v``
  at the price of ``v`` times more point-to-point messages.
* **ZB-H1** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, section 3): the
  backward is split into ``B`` (input gradient, what the previous stage waits for) and ``W`` (weight
  gradients, deferrable; see ``split.py``). F and B keep 1F1B's order; each W runs in the first gap
  where the next F or B cannot start yet, or before an F that would exceed ``p`` micro-batches in flight.
  With equal F, B and W times the bubble is ``(p - 1) / (3 m + p - 1)``: a third of 1F1B's time.
* **ZBV** (same paper, section 5): two chunks per rank in a V — chunk ``c < p`` on rank ``c``, chunk
  ``c >= p`` on rank ``2p - 1 - c`` — so the first and the last chunk share rank 0 and the turn at rank
  ``p - 1`` needs no message. The order comes from a greedy list schedule at unit times (B first, then F
  while fewer than ``2p`` chunk-micro-batches — 1F1B's ``p`` stages' worth — are in flight, then W), which
  leaves only the pipeline's fill at the start as bubble.

Actions here are ``F``, ``B`` and (zero-bubble schedules only) ``W``; in the other schedules ``B`` is the
whole backward. Global chunk ``c`` lives on rank ``stage_of(schedule, c, p)``: ``c % p`` except for ZBV.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
SPLIT_BACKWARD = ("zb-h1", "zbv")  # schedules whose B is the input gradient only, with a separate W


class Action(NamedTuple):
    kind: str  # "F", "B" or "W"
    chunk: int  # global chunk index
    mb: int  # micro-batch index

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


def check_schedule(schedule: str, p: int, v: int) -> None:
    """ValueError for a schedule / virtual-stage combination that cannot run on ``p`` stages."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {v!r}")
    if schedule == "zbv":
        if v not in (1, 2):
            raise ValueError(f"schedule='zbv' always runs 2 chunks per rank (the V); got virtual_stages={v}")
        if p < 2:
            raise ValueError(f"schedule='zbv' needs at least 2 pipeline stages (got pp={p})")
    elif schedule == "interleaved":
        if v < 2:
            raise ValueError(f"schedule='interleaved' needs virtual_stages >= 2 (got {v}); with one chunk per "
                             f"rank use schedule='1f1b'")
        if p < 2:
            raise ValueError(f"schedule='interleaved' needs at least 2 pipeline stages (got pp={p})")
    elif v != 1:
        raise ValueError(f"virtual_stages={v} only applies to schedule='interleaved' (got {schedule!r})")


def check_config(schedule: str, p: int, m: int, v: int) -> None:
    """ValueError (naming the numbers) for a schedule that cannot run with these degrees."""
    check_schedule(schedule, p, v)
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {m!r}")
    if m < p:
        raise ValueError(f"num_microbatches ({m}) is smaller than the number of pipeline stages ({p}); "
                         f"use at least {p} micro-batches (more shrink the bubble (p-1)/(m+p-1))")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"interleaved 1F1B needs num_microbatches ({m}) to be a multiple of the number of "
                         f"pipeline stages ({p}); try {(m // p + 1) * p}")


def chunks_per_stage(schedule: str, v: int) -> int:
    """Model chunks each rank holds: ``v`` for interleaving, 2 for ZBV, 1 otherwise."""
    return 2 if schedule == "zbv" else v


def stage_of(schedule: str, c: int, p: int) -> int:
    """The pipeline rank that holds global chunk ``c``: round robin, or the V of ZBV."""
    if schedule == "zbv":
        return c if c < p else 2 * p - 1 - c
    return c % p


def gpipe(rank: int, p: int, m: int) -> list[Action]:
    return [Action("F", rank, i) for i in range(m)] + [Action("B", rank, i) for i in range(m)]


def one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    out = [Action("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: the forward of mb warmup+i, then the backward of mb i
        out += [Action("F", rank, warmup + i), Action("B", rank, i)]
    out += [Action("B", rank, i) for i in range(m - warmup, m)]
    return out


def interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron-LM's interleaved order: the k-th forward of this rank works on micro-batch
    ``(k // (p v)) p + k % p`` of local chunk ``(k // p) % v``; backwards run the chunks in reverse."""
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        local = within // p
        if backward:
            local = v - 1 - local
        return local * p + rank, group * p + within % p

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    out = [Action("F", *unit(k, False)) for k in range(warmup)]
    for i in range(total - warmup):
        out += [Action("F", *unit(warmup + i, False)), Action("B", *unit(i, True))]
    out += [Action("B", *unit(k, True)) for k in range(total - warmup, total)]
    return out


@functools.lru_cache(maxsize=64)
def zero_bubble(schedule: str, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """The action lists of every rank for "zb-h1" or "zbv" (see the module doc), from a list schedule
    played at unit F, B and W times. Each W follows its own B, in micro-batch order per chunk."""
    num_chunks = p if schedule == "zb-h1" else 2 * p
    mine = [[c for c in range(num_chunks) if stage_of(schedule, c, p) == r] for r in range(p)]
    limit = p * len(mine[0])  # 1F1B's p micro-batches of whole-stage activations
    order = [list(one_f_one_b(r, p, m)) for r in range(p)] if schedule == "zb-h1" else None
    done: dict[Action, int] = {}
    nxt = {(k, c): 0 for k in "FBW" for c in range(num_chunks)}
    free, alive, pos = [0] * p, [0] * p, [0] * p
    lists: list[list[Action]] = [[] for _ in range(p)]
    total, t = 3 * m * len(mine[0]), 0

    def ready(r: int) -> dict[str, list[Action]]:
        out = {"F": [], "B": [], "W": []}
        for c in mine[r]:
            i = nxt[("F", c)]
            if i < m and alive[r] < limit and (c == 0 or done.get(Action("F", c - 1, i), t + 1) <= t):
                out["F"].append(Action("F", c, i))
            i = nxt[("B", c)]
            if i < m and done.get(Action("F", c, i), t + 1) <= t and (
                    c == num_chunks - 1 or done.get(Action("B", c + 1, i), t + 1) <= t):
                out["B"].append(Action("B", c, i))
            i = nxt[("W", c)]
            if i < m and done.get(Action("B", c, i), t + 1) <= t:
                out["W"].append(Action("W", c, i))
        return out

    while any(len(a) < total for a in lists):
        for r in range(p):
            if free[r] > t or len(lists[r]) == total:
                continue
            cand, pick = ready(r), None
            if order is not None:  # ZB-H1: F and B in 1F1B's order, W into the gaps
                if pos[r] < len(order[r]) and order[r][pos[r]] in cand[order[r][pos[r]].kind]:
                    pick = order[r][pos[r]]
                    pos[r] += 1
            else:  # ZBV: B first (the critical path), then F, earliest micro-batch, deepest chunk
                for kind in "BF":
                    if cand[kind]:
                        pick = min(cand[kind], key=lambda a: (a.mb, -a.chunk))
                        break
            if pick is None and cand["W"]:
                pick = min(cand["W"], key=lambda a: (a.mb, a.chunk))
            if pick is None:
                continue
            nxt[(pick.kind, pick.chunk)] += 1
            done[pick] = free[r] = t + 1
            alive[r] += {"F": 1, "B": 0, "W": -1}[pick.kind]
            lists[r].append(pick)
        later = [f for f in free if f > t]
        if not later:  # nobody busy and nobody could start: the rules above cannot finish
            raise RuntimeError(f"schedule {schedule} (p={p}, m={m}) has no valid list order")
        t = min(later)
    return tuple(tuple(a) for a in lists)


def build(schedule: str, rank: int, p: int, m: int, v: int = 1) -> list[Action]:
    check_config(schedule, p, m, v)
    if schedule == "gpipe":
        return gpipe(rank, p, m)
    if schedule == "1f1b":
        return one_f_one_b(rank, p, m)
    if schedule in SPLIT_BACKWARD:
        return list(zero_bubble(schedule, p, m)[rank])
    return interleaved(rank, p, m, v)


def theoretical_bubble(p: int, m: int, v: int = 1, schedule: str | None = None) -> float:
    """Idle fraction of a step when every chunk takes the same time and messages are free.

    ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B; interleaving divides the bubble *time* by ``v``, which
    as a fraction of the step is ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021, eq. in sec. 2.2).
    Zero-bubble schedules: the simulated bubble of their lists at equal F, B and W times (for ZB-H1 that
    is Qi et al.'s ``(p - 1) / (3 m + p - 1)``)."""
    if schedule in SPLIT_BACKWARD:
        return simulate(schedule, p, m)["bubble"]
    return (p - 1) / (v * m + p - 1)


def inflight_limit(schedule: str, rank: int, p: int, m: int, v: int = 1) -> int:
    """Most (chunk, micro-batch) activation sets stage ``rank`` holds at once under ``schedule`` (for the
    zero-bubble schedules: whose W has not run)."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    if schedule in SPLIT_BACKWARD:
        return simulate(schedule, p, m)["peak_inflight"][rank]
    return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)


# ------------------------------------------------------------------------------------ message order


def messages_from(actions: list[Action], sender: int, dst: int, p: int, num_chunks: int,
                  schedule: str = "1f1b") -> list[tuple]:
    """The messages ``sender`` sends to ``dst`` during one step, in the order it sends them.

    ``("meta", b)`` precedes the first activation crossing boundary ``b`` (between chunk ``b`` and
    ``b + 1``) in a step: the shape/dtype handshake. ``("act", b, mb)`` goes forward, ``("grad", b, mb)``
    (the gradient of boundary ``b``'s activation) backward. Point-to-point messages between one pair of
    ranks are matched first-in first-out, so a receiver that posts its receives in exactly this order
    can never pair a buffer with the wrong message."""
    out, announced = [], set()
    for a in actions:
        if a.kind == "F" and a.chunk + 1 < num_chunks and stage_of(schedule, a.chunk + 1, p) == dst:
            if a.chunk not in announced:
                announced.add(a.chunk)
                out.append(("meta", a.chunk))
            out.append(("act", a.chunk, a.mb))
        elif a.kind == "B" and a.chunk > 0 and stage_of(schedule, a.chunk - 1, p) == dst:
            out.append(("grad", a.chunk - 1, a.mb))
    assert sender != dst
    return out


# ---------------------------------------------------------------------------------------- simulation


def simulate(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 1.0,
             t_w: float = 1.0) -> dict:
    """Run the action lists against each other with fixed compute times and free messages.

    ``t_f``, ``t_b``, ``t_w``: a whole stage's forward, input-gradient and weight-gradient times (a chunk
    takes its share); schedules without a W run ``t_b + t_w`` in their B. Returns per-stage busy/idle
    time and peak in-flight count; raises RuntimeError on a deadlock (no stage can make progress). Used by
    tests to check every schedule is deadlock-free and meets its theory."""
    v = chunks_per_stage(schedule, v)
    lists = [build(schedule, r, p, m, v) for r in range(p)]
    split = schedule in SPLIT_BACKWARD
    cost_of = {"F": t_f / v, "B": (t_b if split else t_b + t_w) / v, "W": t_w / v}
    return play(lists, schedule, p, lambda r, a: cost_of[a.kind])


def play(lists, schedule: str, p: int, cost, latency: float = 0.0) -> dict:
    """Play every stage's action list against the others: each action starts when its stage is free and
    its input is there (``latency`` after the action that produced it, when that ran on another stage).
    ``cost(rank, action)``: the action's compute time. Same result dict as :func:`simulate`."""
    num_chunks = max(a.chunk for actions in lists for a in actions) + 1
    split = schedule in SPLIT_BACKWARD
    done: dict[Action, float] = {}
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    alive, peak = [0] * p, [0] * p
    while any(pos[r] < len(lists[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] >= len(lists[r]):
                continue
            a = lists[r][pos[r]]
            if a.kind == "F":
                dep = Action("F", a.chunk - 1, a.mb) if a.chunk > 0 else None
            elif a.kind == "W":
                dep = Action("B", a.chunk, a.mb)
            elif a.chunk + 1 < num_chunks:
                dep = Action("B", a.chunk + 1, a.mb)
            else:
                dep = Action("F", a.chunk, a.mb)
            if dep is not None and dep not in done:
                continue
            arrives = 0.0 if dep is None else done[dep] + (
                latency if stage_of(schedule, dep.chunk, p) != r else 0.0)
            spent = cost(r, a)
            clock[r] = max(clock[r], arrives) + spent
            busy[r] += spent
            done[a] = clock[r]
            freed = "W" if split else "B"
            alive[r] += 1 if a.kind == "F" else -1 if a.kind == freed else 0
            peak[r] = max(peak[r], alive[r])
            pos[r] += 1
            progressed = True
        if not progressed:
            stuck = {r: lists[r][pos[r]] for r in range(p) if pos[r] < len(lists[r])}
            raise RuntimeError(f"schedule {schedule} (p={p}) deadlocks at {stuck}")
    end = max(clock)
    idle = [end - b for b in busy]
    return {"step": end, "busy": busy, "idle": idle, "peak_inflight": peak,
            "bubble": sum(idle) / (p * end) if end > 0 else 0.0}
