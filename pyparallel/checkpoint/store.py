"""Saving and loading checkpoints, written so that a crash never loses the last one.

Atomicity: files go to ``.tmp-step-...``, each is fsynced, the manifest is written and fsynced, and the
folder is renamed into place; only then is ``latest`` replaced (write + fsync + rename). A crash at any
moment leaves the previous checkpoint and ``latest`` intact; ``load`` refuses a folder whose manifest is
missing or whose checksums do not match, and says which file is wrong.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from pyparallel import comm
from pyparallel.checkpoint.format import (
    FORMAT,
    VERSION,
    CheckpointError,
    Piece,
    _assemble,
    _cut,
    _sha256,
    read_manifest,
)
from pyparallel.checkpoint.protocol import (
    _load_model,
    _load_optimizer,
    _module_pieces,
    _optimizer_groups,
    _optimizer_pieces,
)

# ----------------------------------------------------------------------------------------------- save


def _rank_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str, model, optimizer=None, *, step: int, extra: dict | None = None, mesh=None) -> str:
    """Write a checkpoint of ``model`` (and ``optimizer``) for ``step`` under ``root``; every rank calls it.

    Returns the checkpoint folder. ``extra`` (JSON-serialisable) comes back from :func:`load`."""
    rank, world = _rank_world()
    mesh = mesh if mesh is not None else getattr(model, "mesh", None)
    group = mesh.world_group if mesh is not None else None
    if group is None and world > 1:
        raise ValueError(f"checkpoint.save on {world} processes needs the mesh (mesh=...), so that every "
                         f"rank's pieces reach the manifest")
    final = os.path.join(root, f"step-{step:08d}")
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of the same step
        os.makedirs(tmp)
    _barrier(group)
    pieces = _module_pieces(model) + (_optimizer_pieces(model, optimizer) if optimizer is not None else [])
    mine = [(p, t) for p, t in pieces if (p.owner if p.owner is not None else rank == 0)]
    fname = f"rank-{rank:05d}.safetensors"
    records = []
    tensors = {}
    for i, (piece, tensor) in enumerate(mine):
        key = f"{i:06d}"
        flat = tensor.detach().reshape(-1).to("cpu").contiguous()
        if flat.numel() != piece.flat_len:
            raise ValueError(f"checkpoint piece {piece.name}: tensor has {flat.numel()} elements, piece "
                             f"describes {piece.flat_len}")
        tensors[key] = flat.clone()
        records.append({**asdict(piece), "key": key, "file": fname, "dtype": str(flat.dtype)})
    files = {}
    if tensors:
        path = os.path.join(tmp, fname)
        save_file(tensors, path)
        _fsync_file(path)
        files[fname] = {"sha256": _sha256(path), "bytes": os.path.getsize(path)}
    everyone = comm.all_gather_object((records, files), group) if group is not None else [(records, files)]
    if rank == 0:
        manifest = {
            "format": FORMAT, "version": VERSION, "step": step, "extra": extra or {}, "world_size": world,
            "layout": _layout(mesh), "files": {}, "pieces": [],
            "optimizer_groups": _optimizer_groups(optimizer) if optimizer is not None else None,
        }
        for recs, fs in everyone:
            manifest["pieces"].extend(recs)
            manifest["files"].update(fs)
        _before_commit()
        mpath = os.path.join(tmp, "manifest.json")
        with open(mpath, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step: move the old one aside, then drop it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_latest(root, os.path.basename(final))
    _barrier(group)
    return final


def _before_commit() -> None:
    """Test seam: the moment between writing the data files and committing the manifest."""


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, ".latest.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "latest"))
    _fsync_dir(root)


def _layout(mesh) -> dict:
    if mesh is None:
        return {"dp": 1, "tp": 1, "pp": 1}
    return {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}


def _barrier(group) -> None:
    if group is not None and group.size > 1:
        comm.barrier(group)


# ----------------------------------------------------------------------------------------------- load


def resolve(root: str) -> str:
    """The checkpoint folder ``root`` names: itself if it holds a manifest, else what ``latest`` points to."""
    if os.path.exists(os.path.join(root, "manifest.json")):
        return root
    latest = os.path.join(root, "latest")
    if not os.path.exists(latest) and any(f.endswith(".safetensors") for f in _listdir(root)):
        return root  # a step folder without its manifest: read_manifest says it is incomplete
    if not os.path.exists(latest):
        raise CheckpointError(f"no checkpoint at {root!r}: neither a manifest.json nor a 'latest' pointer")
    with open(latest) as f:
        return os.path.join(root, f.read().strip())


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


class _Reader:
    """Assembles global tensors (one at a time) from the saved pieces."""

    def __init__(self, folder: str, manifest: dict):
        self.folder = folder
        self.by_name: dict[str, list[dict]] = {}
        for rec in manifest["pieces"]:
            self.by_name.setdefault(rec["name"], []).append(rec)
        self._cache: tuple[str, torch.Tensor] | None = None

    def names(self):
        return self.by_name.keys()

    def has(self, name: str) -> bool:
        return name in self.by_name

    def full(self, name: str) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == name:
            return self._cache[1]
        recs = self.by_name.get(name)
        if not recs:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        items = []
        for rec in recs:
            with safe_open(os.path.join(self.folder, rec["file"]), framework="pt") as f:
                items.append((rec, f.get_tensor(rec["key"])))
        out = _assemble(name, items)
        self._cache = (name, out)
        return out

    def piece(self, piece: Piece) -> torch.Tensor:
        """The data ``piece`` describes, cut from the saved global tensor (1-D, flat_len elements)."""
        return _cut(self.full(piece.name), piece)


@torch.no_grad()
def load(root: str, model, optimizer=None, *, mesh=None, verify: bool = True) -> dict:
    """Load the checkpoint at ``root`` (a step folder, or a root with ``latest``) into ``model`` and
    ``optimizer`` in their *current* layout. Returns ``{"step", "extra", "layout"}``."""
    folder = resolve(root)
    manifest = read_manifest(folder, verify=verify)
    reader = _Reader(folder, manifest)
    _load_model(model, reader)
    if optimizer is not None:
        _load_optimizer(model, optimizer, reader, manifest)
    return {"step": manifest["step"], "extra": manifest["extra"], "layout": manifest["layout"]}


def read_tensors(root: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every global tensor of checkpoint ``root`` whose name starts with ``prefix`` (model weights under
    ``model/``, optimizer state under ``optim/``), assembled from the pieces of whatever layout saved it."""
    folder = resolve(root)
    reader = _Reader(folder, read_manifest(folder))
    return {n: reader.full(n).clone() for n in sorted(reader.names()) if n.startswith(prefix)}


def export_consolidated(root: str, out_file: str, prefix: str = "model/") -> list[str]:
    """Write the model's full tensors of checkpoint ``root`` into one safetensors file (keys without the
    ``model/`` prefix, as ``load_state_dict`` of the unparallelised model expects). Returns the keys."""
    folder = resolve(root)
    reader = _Reader(folder, read_manifest(folder))
    tensors = {n[len(prefix):]: reader.full(n).clone() for n in sorted(reader.names()) if n.startswith(prefix)}
    save_file(tensors, out_file)
    return list(tensors)
