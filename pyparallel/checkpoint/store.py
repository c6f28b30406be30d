"""Saving and loading checkpoints, written so that a crash never loses the last one.

Atomicity: files go to ``.tmp-step-N``, each is fsynced, the manifest is written and fsynced, and the
folder is renamed to a name nothing else uses (``step-N``; ``step-N.1``, ``step-N.2``, ... when step N is
saved again while an older copy exists); only then is ``latest`` replaced (write + fsync + rename), and
only after that is the older copy of the step removed. So a kill at any moment, re-saves included, leaves
``latest`` naming a complete folder; ``load`` refuses a folder whose manifest is missing or whose checksums
do not match, and says which file is wrong. ``.tmp-step-*`` folders left by killed saves are removed by the
next save that commits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from pyparallel import comm
from pyparallel.checkpoint.export import hf_config_of
from pyparallel.checkpoint.format import (
    FORMAT,
    VERSION,
    CheckpointError,
    Piece,
    _assemble,
    _cut,
    _sha256,
    read_manifest,
    require_all_files,
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


STORAGES = ("shared", "node-local")


def _check_storage(storage: str) -> None:
    if storage not in STORAGES:
        raise ValueError(f"checkpoint storage must be one of {', '.join(map(repr, STORAGES))}, got {storage!r}")


def save(root: str, model, optimizer=None, *, step: int, extra: dict | None = None, mesh=None,
         storage: str = "shared") -> str:
    """Write a checkpoint of ``model`` (and ``optimizer``) for ``step`` under ``root``; every rank calls it.

    Returns the checkpoint folder (this rank's node's, with ``storage="node-local"``). ``extra``
    (JSON-serialisable) comes back from :func:`load`.

    ``storage="shared"`` (the default): ``root`` is one folder every node sees. Three phases, each ending in
    a small exchange that doubles as the barrier: rank 0 prepares the folder, every rank writes its pieces,
    rank 0 commits. An error in any phase on any rank is raised on every rank (the failing rank's own
    exception there, a CheckpointError naming it elsewhere), so no rank is left waiting for a peer that
    gave up. A folder that is not the same on every node is refused.

    ``storage="node-local"``: ``root`` is a folder on each node's own disk; each node keeps what its ranks
    need to resume in the same layout, and every node's leader commits a manifest of its own
    (:mod:`pyparallel.checkpoint.nodelocal`). Load it with ``load(..., storage="node-local")``."""
    _check_storage(storage)
    rank, world = _rank_world()
    mesh = mesh if mesh is not None else getattr(model, "mesh", None)
    group = mesh.world_group if mesh is not None else None
    if group is None and world > 1:
        raise ValueError(f"checkpoint.save on {world} processes needs the mesh (mesh=...), so that every "
                         f"rank's pieces reach the manifest")
    if storage == "node-local":
        from pyparallel.checkpoint import nodelocal

        return nodelocal.save(root, model, optimizer, step=step, extra=extra, mesh=mesh, group=group, rank=rank,
                              world=world)
    what = f"checkpoint.save of step {step} into {root!r}"
    tmp = os.path.join(root, f".tmp-step-{step:08d}")
    started = time.time()
    hf_config = hf_config_of(model) if rank == 0 else None
    _kill_point("start")
    name = _exchange(group, what, "preparing the folder", lambda: _prepare(root, tmp, step) if rank == 0 else None)[0]
    _kill_point("prepared")
    everyone = _exchange(group, what, "writing its pieces", lambda: _write_pieces(model, optimizer, tmp, rank))
    _kill_point("written")

    def commit():
        if rank != 0:
            return None
        manifest = {
            "format": FORMAT, "version": VERSION, "step": step, "extra": extra or {}, "world_size": world,
            "layout": _layout(mesh), "files": {}, "pieces": [],
            "optimizer_groups": _optimizer_groups(optimizer) if optimizer is not None else None,
        }
        if hf_config is not None:  # export_pretrained writes it as config.json
            manifest["hf_config"] = hf_config
        for recs, fs in everyone:
            manifest["pieces"].extend(recs)
            manifest["files"].update(fs)
        unseen = sorted(f for f in manifest["files"] if not os.path.exists(os.path.join(tmp, f)))
        if unseen:  # written into a same-named folder that rank 0 does not see: another node's local disk
            raise CheckpointError(f"rank 0 does not see {', '.join(unseen[:4])} that other ranks wrote into "
                                  f"{tmp!r}: a checkpoint folder must be one directory shared by every node; "
                                  f"node-local directories are not supported")
        _commit(root, tmp, name, step, manifest, started)
        return None

    _exchange(group, what, "committing", commit)
    _kill_point("done")
    return os.path.join(root, name)


def _prepare(root: str, tmp: str, step: int) -> str:
    """Rank 0: an empty ``tmp`` folder, and the name the step will be committed under (a fresh one)."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint root {root!r} is a file, not a folder")
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save of the same step
    os.makedirs(tmp)
    return _fresh_name(root, step)


def _fresh_name(root: str, step: int) -> str:
    """``step-N``, or while that exists (a re-save of step N) ``step-N.1``, ``step-N.2``, ...: the new copy
    never replaces the old one in place, so ``latest`` always names a complete folder."""
    base = f"step-{step:08d}"
    name, k = base, 0
    while os.path.lexists(os.path.join(root, name)):
        k += 1
        name = f"{base}.{k}"
    return name


def _write_pieces(model, optimizer, tmp: str, rank: int) -> tuple[list, dict]:
    """This rank's data file in ``tmp`` (fsynced); returns its manifest records and file checksums."""
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
    if tensors and not os.path.isdir(tmp):
        raise CheckpointError(f"rank {rank} ({socket.gethostname()}) does not see the folder {tmp!r} that rank 0 "
                              f"created: a checkpoint folder must be one directory shared by every node (a "
                              f"network or parallel filesystem); node-local directories are not supported")
    if tensors:
        path = os.path.join(tmp, fname)
        save_file(tensors, path)
        _fsync_file(path)
        files[fname] = {"sha256": _sha256(path), "bytes": os.path.getsize(path)}
    return records, files


def _commit(root: str, tmp: str, name: str, step: int, manifest: dict, started: float, cleanup: bool = True) -> None:
    """Rank 0: manifest (fsynced), rename into place, switch ``latest``, then drop what it replaced (unless
    ``cleanup`` is False: a node-local save drops it once every node has committed)."""
    _before_commit()
    mpath = os.path.join(tmp, "manifest.json")
    with open(mpath, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _kill_point("manifest")
    os.rename(tmp, os.path.join(root, name))
    _fsync_dir(root)
    _kill_point("renamed")
    _write_latest(root, name)
    _kill_point("latest")
    if cleanup:
        _remove_replaced(root, name, step, started)


def _remove_replaced(root: str, name: str, step: int, started: float) -> None:
    """After ``latest`` names the new folder: older copies of the same step, and ``.tmp-step-*`` folders
    that were already there when this save began (saves killed before they committed)."""
    for entry in _listdir(root):
        path = os.path.join(root, entry)
        m = _STEP_DIR.match(entry)
        if m and int(m.group(1)) == step and entry != name:
            shutil.rmtree(path, ignore_errors=True)
        elif entry.startswith(".tmp-step-"):
            try:
                stale = os.path.getmtime(path) < started
            except OSError:
                continue
            if stale:
                shutil.rmtree(path, ignore_errors=True)


def _exchange(group, what: str, phase: str, fn) -> list:
    """Run ``fn`` on this rank and all-gather its result, or the error it raised, from every rank. An error
    anywhere is raised everywhere: the original exception on the rank that raised it, a CheckpointError
    naming that rank on the others."""
    try:
        mine, err = (fn(), None)
    except Exception as exc:  # noqa: BLE001 (re-raised below, after the peers have heard of it)
        mine, err = None, exc
    note = None if err is None else f"{type(err).__name__}: {err}"
    everyone = comm.all_gather_object((mine, note), group) if group is not None and group.size > 1 \
        else [(mine, note)]
    if err is not None:
        raise err
    failed = [(r, n) for r, (_, n) in enumerate(everyone) if n is not None]
    if failed:
        r, n = failed[0]
        raise CheckpointError(f"{what} failed on rank {group.global_rank(r)} while {phase}: {n}")
    return [v for v, _ in everyone]


def _kill_point(name: str) -> None:
    """Test seam: called on every rank at each step of :func:`save` (tests/test_faults.py kills a process
    at each one in turn)."""


def _before_commit() -> None:
    """Test seam: the moment between writing the data files and committing the manifest."""


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, ".latest.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    _kill_point("latest-written")
    os.replace(tmp, os.path.join(root, "latest"))
    _fsync_dir(root)


def _layout(mesh) -> dict:
    if mesh is None:
        return {"dp": 1, "tp": 1, "pp": 1}
    return {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp}


# ----------------------------------------------------------------------------------------------- load

_STEP_DIR = re.compile(r"^step-(\d{8,})(?:\.(\d+))?$")


def complete_steps(root: str) -> list[str]:
    """The step folders under ``root`` that hold a manifest, oldest step first (the checksums are not
    read here; :func:`read_manifest` does that)."""
    found = []
    for entry in _listdir(root):
        m = _STEP_DIR.match(entry)
        mpath = os.path.join(root, entry, "manifest.json")
        if m and os.path.isfile(mpath):
            found.append((int(m.group(1)), os.path.getmtime(mpath), os.path.join(root, entry)))
    return [path for _, _, path in sorted(found)]


def newest_complete(root: str) -> str | None:
    """The newest step folder under ``root`` whose manifest and checksums are intact, or None."""
    for folder in reversed(complete_steps(root)):
        try:
            read_manifest(folder)
        except CheckpointError:
            continue
        return folder
    return None


def resolve(root: str) -> str:
    """The checkpoint folder ``root`` names: itself if it holds a manifest, else what ``latest`` points to."""
    if os.path.exists(os.path.join(root, "manifest.json")):
        return root
    latest = os.path.join(root, "latest")
    if not os.path.exists(latest) and any(f.endswith(".safetensors") for f in _listdir(root)):
        return root  # a step folder without its manifest: read_manifest says it is incomplete
    if not os.path.exists(latest):
        raise CheckpointError(f"no checkpoint at {root!r}: neither a manifest.json nor a 'latest' pointer")
    with open(latest, errors="replace") as f:
        name = f.read().strip()
    folder = os.path.join(root, name)
    problem = None
    if not name:
        problem = f"{latest!r} is empty"
    elif not os.path.isdir(folder):
        problem = f"'latest' in {root!r} names {name!r}, which does not exist"
    elif not _listdir(folder):
        problem = f"'latest' in {root!r} names {name!r}, an empty folder"
    elif not os.path.exists(os.path.join(folder, "manifest.json")):
        problem = f"'latest' in {root!r} names {name!r}, which has no manifest.json"
    if problem is None:
        return folder
    steps = [os.path.basename(f) for f in complete_steps(root)]
    raise CheckpointError(f"{problem}: it was changed or removed after it was saved (a save switches 'latest' "
                          f"only to a complete folder). Complete steps here: {steps or 'none'}; load one by "
                          f"its folder")


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
        self._cache = None  # the previous tensor is not kept alive while this one is assembled
        out = _assemble(name, self._read(recs))
        self._cache = (name, out)
        return out

    def _read(self, recs):
        for rec in recs:  # one piece at a time: _assemble places it before the next is read
            with safe_open(os.path.join(self.folder, rec["file"]), framework="pt") as f:
                data = f.get_tensor(rec["key"])
            yield rec, data

    def piece(self, piece: Piece) -> torch.Tensor:
        """The data ``piece`` describes, cut from the saved global tensor (1-D, flat_len elements)."""
        return _cut(self.full(piece.name), piece)


@torch.no_grad()
def load(root: str, model, optimizer=None, *, mesh=None, verify: bool = True, storage: str = "shared") -> dict:
    """Load the checkpoint at ``root`` (a step folder, or a root with ``latest``) into ``model`` and
    ``optimizer`` in their *current* layout. Returns ``{"step", "extra", "layout"}``.

    ``storage="node-local"``: ``root`` is each node's own folder of a checkpoint saved with that storage; a
    collective over the mesh's world group (``mesh=``, else ``model.mesh``) that first checks, on every
    rank together, that every node's folder holds the same save and every piece its ranks need, and
    otherwise raises the same CheckpointError on every rank (:mod:`pyparallel.checkpoint.nodelocal`)."""
    _check_storage(storage)
    if storage == "node-local":
        from pyparallel.checkpoint import nodelocal

        mesh = mesh if mesh is not None else getattr(model, "mesh", None)
        return nodelocal.load(root, model, optimizer, mesh=mesh, verify=verify)
    folder = resolve(root)
    manifest = read_manifest(folder, verify=verify)
    require_all_files(folder, manifest, "checkpoint.load (shared storage)")
    reader = _Reader(folder, manifest)
    _load_model(model, reader)
    if optimizer is not None:
        _load_optimizer(model, optimizer, reader, manifest)
    return {"step": manifest["step"], "extra": manifest["extra"], "layout": manifest["layout"]}


def read_tensors(root: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every global tensor of checkpoint ``root`` whose name starts with ``prefix`` (model weights under
    ``model/``, optimizer state under ``optim/``), assembled from the pieces of whatever layout saved it."""
    folder = resolve(root)
    manifest = read_manifest(folder)
    require_all_files(folder, manifest, "read_tensors")
    reader = _Reader(folder, manifest)
    return {n: reader.full(n).clone() for n in sorted(reader.names()) if n.startswith(prefix)}
