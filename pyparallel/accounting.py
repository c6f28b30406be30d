"""Per-rank traffic accounting for pyparallel/comm.py: calls, payload bytes and wire bytes per op and axis.

Wire bytes follow nccl-tests' bus-bandwidth convention: all-reduce moves 2(N-1)/N of the payload per rank,
all-gather and reduce-scatter (N-1)/N of the full (gathered / unscattered) tensor, broadcast and send 1x,
and a receive 0x (a message is its sender's traffic). comm.py records every call here; users read
``pyparallel.comm_stats()`` and zero it with ``pyparallel.reset_comm_stats()``.
"""

from __future__ import annotations

import threading
from collections import defaultdict

_lock = threading.Lock()
_stats: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])  # calls, payload, wire


def _wire_factor(op: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "recv":
        return 0.0  # a received message is its sender's wire traffic; count it once, there
    return 1.0  # broadcast, send


def account(op: str, axis: str, group_size: int, payload_bytes: int) -> None:
    """Record one call of ``op`` on mesh axis ``axis`` over ``group_size`` ranks."""
    with _lock:
        entry = _stats[(op, axis)]
        entry[0] += 1
        entry[1] += int(payload_bytes)
        entry[2] += int(round(payload_bytes * _wire_factor(op, group_size)))


def reset_comm_stats() -> None:
    """Zero every counter (call at the start of the step you want to measure)."""
    with _lock:
        _stats.clear()


def comm_stats() -> dict:
    """This rank's traffic since the last reset.

    Returns ``{"total": {...}, "by_op": {op: {...}}, "by_axis": {axis: {...}}, "by_op_axis": {"op@axis":
    {...}}}`` where each leaf is ``{"calls", "payload_bytes", "wire_bytes"}``.
    """

    def leaf():
        return {"calls": 0, "payload_bytes": 0, "wire_bytes": 0}

    out = {"total": leaf(), "by_op": defaultdict(leaf), "by_axis": defaultdict(leaf), "by_op_axis": {}}
    with _lock:
        items = list(_stats.items())
    for (op, axis), (calls, payload, wire) in items:
        for bucket in (out["total"], out["by_op"][op], out["by_axis"][axis]):
            bucket["calls"] += calls
            bucket["payload_bytes"] += payload
            bucket["wire_bytes"] += wire
        out["by_op_axis"][f"{op}@{axis}"] = {"calls": calls, "payload_bytes": payload, "wire_bytes": wire}
    out["by_op"] = dict(out["by_op"])
    out["by_axis"] = dict(out["by_axis"])
    return out
