"""Debug mode's fingerprint of a collective: what each rank believes the group's next call is.

Why: ranks that call different collectives, or the same one with another shape or dtype, do not fail --
they hang until the timeout, or worse, exchange bytes that mean different things on each side. With
``PYPARALLEL_DEBUG=1`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, the switch of torch's own check,
ProcessGroupWrapper) comm.py all-gathers a fixed-size row of integers -- (sequence number, op, dtype,
shape) -- before every collective, so that ranks which disagree all fail at once, with every rank's side
named. This module is the pure part of that check: the switch, the encoding of a row, its decoding for
the message, and the comparison. The all-gather itself stays in comm.py (``_check_fingerprint``): only
comm.py issues collectives (DESIGN.md principle 3).
"""

from __future__ import annotations

import os
import zlib

import torch

LENGTH = 12  # integers per row: 4 of header, then up to 6 dimensions, zero-padded (ranks must agree on it)

_OP_CODES = {
    name: i
    for i, name in enumerate(
        ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "all_gather_object", "all_to_all"]
    )
}
_DTYPES: dict[torch.dtype, int] = {}  # the dtypes this process has encoded, to name them when decoding


def debug_enabled() -> bool:
    return os.environ.get("PYPARALLEL_DEBUG", "0") not in ("", "0") or (
        os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )


def _dtype_code(dtype: torch.dtype) -> int:
    """The same on every rank and every run (a CRC of the name, not Python's salted hash)."""
    return _DTYPES.setdefault(dtype, zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF)


def encode(op: str, seq: int, tensor: torch.Tensor | None) -> list[int]:
    """This rank's row for call ``seq`` of a group: ``op`` on ``tensor`` (None for a barrier)."""
    shape = list(tensor.shape) if tensor is not None else []
    dtype = _dtype_code(tensor.dtype) if tensor is not None else 0
    fp = [seq, _OP_CODES.get(op, 99), dtype, len(shape)] + shape[:6]
    return fp + [0] * (LENGTH - len(fp))


def decode(fp: list[int]) -> str:
    codes = {v: k for k, v in _OP_CODES.items()}
    dtypes = {v: k for k, v in _DTYPES.items()}
    ndim = fp[3]
    shape = fp[4 : 4 + min(ndim, 6)]
    return f"call #{fp[0]} {codes.get(fp[1], '?')}(shape={tuple(shape)}, dtype={dtypes.get(fp[2], fp[2])})"


def disagreement(rows: list[list[int]], ranks) -> str:
    """Every rank's side ("rank 0: call #3 all_reduce(...); rank 1: ...") when the gathered ``rows`` (one per
    group rank, ``ranks`` their global ranks) differ; "" when they all agree."""
    if all(r == rows[0] for r in rows):
        return ""
    return "; ".join(f"rank {ranks[i]}: {decode(r)}" for i, r in enumerate(rows))
