"""The checkpoint format itself: :class:`Piece`, :class:`CheckpointError`, the manifest and the geometry of
boxes. A leaf module (stdlib and torch only), so that every strategy can describe its shards without
importing the save/load machinery.

Format (one folder per step, ``<root>/step-00000010/``):

* ``rank-00003.safetensors`` per writing rank: the *pieces* of global tensors that rank owns.
* ``manifest.json``, written last: for every piece its global name, global shape, the N-D box it covers
  (offsets and sizes, as a TP slice is) and the flat range inside that box (as a ZeRO shard of a flattened
  parameter is); the sha256 and size of every file; step, user ``extra``, the saving layout and the
  optimizer's hyper-parameters.

Because every piece says where it sits in the *global* tensor, loading is layout-independent: each rank
asks for the pieces its current layout needs, and they are cut out of whatever pieces were saved.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass

import torch

FORMAT = "pyparallel-checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message says which file and why."""


@dataclass
class Piece:
    """A block of a global tensor: ``box`` (offsets, sizes) in the global tensor, then the row-major flat
    range ``[flat_start, flat_start + flat_len)`` of that box. A whole tensor is one box covering it."""

    name: str
    global_shape: tuple[int, ...]
    box_offsets: tuple[int, ...]
    box_shape: tuple[int, ...]
    flat_start: int = 0
    flat_len: int = -1  # -1: the whole box
    # Whether this rank writes the piece. None: replicated on every rank, written by global rank 0.
    # Sharded strategies set True on exactly one holder of each piece (e.g. DP rank 0 of a TP shard).
    owner: bool | None = None
    # The box is held with its dimensions permuted (``box.permute(perm)``) before flattening: a TP shard of
    # a transformers Conv1D weight ([in, out] globally) is held as [out/t, in], the transposed box.
    perm: tuple[int, ...] | None = None

    def __post_init__(self):
        self.global_shape = tuple(int(x) for x in self.global_shape)
        self.box_offsets = tuple(int(x) for x in self.box_offsets)
        self.box_shape = tuple(int(x) for x in self.box_shape)
        if self.perm is not None:
            self.perm = tuple(int(x) for x in self.perm)
            if sorted(self.perm) != list(range(len(self.box_shape))):
                raise ValueError(f"checkpoint piece {self.name}: perm {self.perm} is not a permutation of the "
                                 f"box's {len(self.box_shape)} dimensions")
        if self.flat_len < 0:
            self.flat_len = _numel(self.box_shape) - self.flat_start

    @staticmethod
    def whole(name: str, shape) -> Piece:
        shape = tuple(shape)
        return Piece(name, shape, (0,) * len(shape), shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# -------------------------------------------------------------------------------------------- manifest


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(folder: str, verify: bool = True) -> dict:
    mpath = os.path.join(folder, "manifest.json")
    if not os.path.exists(mpath):
        raise CheckpointError(f"checkpoint {folder!r} is incomplete: manifest.json is missing (a save was "
                              f"interrupted?); load an earlier step")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {folder!r}: manifest.json is not valid JSON ({exc})") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} is not a {FORMAT} manifest")
    if verify:
        own = manifest.get("node") if manifest.get("storage") == "node-local" else None
        for fname, meta in manifest["files"].items():
            path = os.path.join(folder, fname)
            if not os.path.exists(path):
                if own is not None and meta.get("node") != own:
                    continue  # another node's file of a node-local save: that node's folder holds it
                raise CheckpointError(f"checkpoint {folder!r} is incomplete: {fname} is missing")
            if os.path.getsize(path) != meta["bytes"] or _sha256(path) != meta["sha256"]:
                raise CheckpointError(f"checkpoint {folder!r} is corrupt: {fname} does not match its checksum")
    return manifest


def require_all_files(folder: str, manifest: dict, what: str) -> None:
    """A CheckpointError when ``folder`` is one node's copy of a node-local save that lacks other nodes'
    files (``what`` needs every piece: the shared-storage load, ``read_tensors``, the exports)."""
    if manifest.get("storage") != "node-local":
        return
    missing = sorted(f for f in manifest["files"] if not os.path.exists(os.path.join(folder, f)))
    if not missing:
        return
    nodes = sorted({manifest["files"][f].get("node") for f in missing})
    held = ", ".join(f"node {k} ({', '.join(manifest['nodes'][k]['hosts'])})" for k in nodes if k is not None)
    more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
    raise CheckpointError(f"{folder!r} is node {manifest.get('node')}'s folder of a checkpoint saved with "
                          f"storage='node-local': {', '.join(missing[:4])}{more} are in the folders of {held}, "
                          f"and {what} needs every piece. Load it with storage='node-local' (each rank from its "
                          f"own node's folder, in the layout that saved it), or copy those files from the other "
                          f"nodes' folder of this step into this one")


# -------------------------------------------------------------------------------------------- geometry


def _box_view(full: torch.Tensor, offsets, shape, perm) -> torch.Tensor:
    """The view of ``full`` that a piece's box covers, permuted as the piece holds it."""
    box = full
    for d, (o, s) in enumerate(zip(offsets, shape)):
        box = box.narrow(d, o, s)
    return box.permute(*perm) if perm else box


def _place(out: torch.Tensor, rec: dict, data: torch.Tensor) -> None:
    """Write one saved piece's flat ``data`` into the global tensor ``out``."""
    box = _box_view(out, rec["box_offsets"], rec["box_shape"], rec.get("perm"))
    if box.is_contiguous():  # a whole tensor or a leading-dimension block (ZeRO, row TP): write in place
        box.view(-1)[rec["flat_start"]:rec["flat_start"] + rec["flat_len"]] = data.reshape(-1)
        return
    tmp = box.contiguous().reshape(-1)
    tmp[rec["flat_start"]:rec["flat_start"] + rec["flat_len"]] = data.reshape(-1)
    box.copy_(tmp.view(box.shape))


def _assemble(name: str, items) -> torch.Tensor:
    """The global tensor ``name`` from ``(record, flat data)`` pairs; CheckpointError when pieces are missing.
    ``items`` is consumed lazily (a generator reading one piece at a time keeps one piece in memory)."""
    items = iter(items)
    first = next(items)
    rec0 = first[0]
    shape = tuple(rec0["global_shape"])
    dtype = getattr(torch, rec0["dtype"].replace("torch.", ""))
    out = torch.empty(shape, dtype=dtype)
    covered = 0
    for rec, data in itertools.chain([first], items):
        _place(out, rec, data)
        covered += rec["flat_len"]
        del data
    if covered < out.numel():
        raise CheckpointError(f"checkpoint tensor {name!r} is only partly covered ({covered} of "
                              f"{out.numel()} elements)")
    return out


def _cut(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The data ``piece`` describes, cut from the global tensor ``full`` (1-D, flat_len elements)."""
    if tuple(full.shape) != piece.global_shape:
        raise CheckpointError(f"{piece.name}: saved with shape {tuple(full.shape)}, the model now has "
                              f"{piece.global_shape}")
    box = _box_view(full, piece.box_offsets, piece.box_shape, piece.perm)
    return box.reshape(-1)[piece.flat_start:piece.flat_start + piece.flat_len]
