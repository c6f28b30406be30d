"""Sharded checkpoints that any later layout can load, written so that a crash never loses the last one.

Format (one folder per step, ``<root>/step-00000010/``):

* ``rank-00003.safetensors`` per writing rank: the *pieces* of global tensors that rank owns.
* ``manifest.json``, written last: for every piece its global name, global shape, the N-D box it covers
  (offsets and sizes, as a TP slice is) and the flat range inside that box (as a ZeRO shard of a flattened
  parameter is); the sha256 and size of every file; step, user ``extra``, the saving layout and the
  optimizer's hyper-parameters.

Because every piece says where it sits in the *global* tensor, loading is layout-independent: each rank
asks for the pieces its current layout needs, and they are cut out of whatever pieces were saved.
Strategies describe their shards through :class:`Piece` lists (``checkpoint_pieces()`` on a wrapper or
optimizer); plain modules and torch optimizers are handled here, replicated on every rank and written
once.

Atomicity: files go to ``.tmp-step-...``, each is fsynced, the manifest is written and fsynced, and the
folder is renamed into place; only then is ``latest`` replaced (write + fsync + rename). A crash at any
moment leaves the previous checkpoint and ``latest`` intact; ``load`` refuses a folder whose manifest is
missing or whose checksums do not match, and says which file is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from pyparallel import comm

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


# ------------------------------------------------------------------------------------ who holds what
# A wrapper that knows its shards says so itself (``checkpoint_pieces`` / ``load_checkpoint_pieces``:
# ``pyparallel.parallelize``'s model and optimizer). ZeRO's wrappers are described by zero/pieces.py;
# every other module (plain, DataParallel, tensor-parallelized, a PipelineParallel stage) and torch
# optimizer by combined/modules.py.


def _zero_model(model):
    from pyparallel.zero.module import ZeroModule

    return model if isinstance(model, ZeroModule) else None


def _module_pieces(model) -> list[tuple[Piece, torch.Tensor]]:
    provider = getattr(model, "checkpoint_pieces", None)
    if provider is not None:
        return provider()
    if _zero_model(model) is not None:
        from pyparallel.zero import pieces as zero_pieces

        return zero_pieces.model_pieces(model)
    from pyparallel.combined import modules

    return modules.module_pieces(model)


def _optimizer_pieces(model, optimizer) -> list[tuple[Piece, torch.Tensor]]:
    provider = getattr(optimizer, "checkpoint_pieces", None)
    if provider is not None:
        return provider()
    if _zero_model(model) is not None:
        from pyparallel.zero import pieces as zero_pieces

        return zero_pieces.optimizer_pieces(model, optimizer)
    from pyparallel.combined import modules

    return modules.optimizer_pieces(model, optimizer)


def _load_model(model, reader) -> None:
    loader = getattr(model, "load_checkpoint_pieces", None)
    if loader is not None:
        return loader(reader, None)
    if _zero_model(model) is not None:
        from pyparallel.zero import pieces as zero_pieces

        return zero_pieces.load_model(model, reader)
    from pyparallel.combined import modules

    return modules.load_module(model, reader)


def _load_optimizer(model, optimizer, reader, manifest) -> None:
    loader = getattr(optimizer, "load_checkpoint_pieces", None)
    if loader is not None:
        return loader(reader, manifest)
    if _zero_model(model) is not None:
        from pyparallel.zero import pieces as zero_pieces

        return zero_pieces.load_optimizer(model, optimizer, reader, manifest)
    from pyparallel.combined import modules

    return modules.load_torch_optimizer(model, optimizer, reader, manifest)


def _optimizer_groups(optimizer) -> list[dict]:
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params" and _jsonable(v)})
    return groups


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


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


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
        for fname, meta in manifest["files"].items():
            path = os.path.join(folder, fname)
            if not os.path.exists(path):
                raise CheckpointError(f"checkpoint {folder!r} is incomplete: {fname} is missing")
            if os.path.getsize(path) != meta["bytes"] or _sha256(path) != meta["sha256"]:
                raise CheckpointError(f"checkpoint {folder!r} is corrupt: {fname} does not match its checksum")
    return manifest


def _box_view(full: torch.Tensor, offsets, shape, perm) -> torch.Tensor:
    """The view of ``full`` that a piece's box covers, permuted as the piece holds it."""
    box = full
    for d, (o, s) in enumerate(zip(offsets, shape)):
        box = box.narrow(d, o, s)
    return box.permute(*perm) if perm else box


def _place(out: torch.Tensor, rec: dict, data: torch.Tensor) -> None:
    """Write one saved piece's flat ``data`` into the global tensor ``out``."""
    box = _box_view(out, rec["box_offsets"], rec["box_shape"], rec.get("perm"))
    tmp = box.contiguous().reshape(-1)
    tmp[rec["flat_start"]:rec["flat_start"] + rec["flat_len"]] = data.reshape(-1)
    box.copy_(tmp.view(box.shape))


def _assemble(name: str, items) -> torch.Tensor:
    """The global tensor ``name`` from ``(record, flat data)`` pairs; CheckpointError when pieces are missing."""
    items = list(items)
    rec0 = items[0][0]
    shape = tuple(rec0["global_shape"])
    dtype = getattr(torch, rec0["dtype"].replace("torch.", ""))
    out = torch.empty(shape, dtype=dtype)
    covered = 0
    for rec, data in items:
        _place(out, rec, data)
        covered += rec["flat_len"]
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


def gather_full(pieces: list[tuple[Piece, torch.Tensor]], group, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """Every global tensor whose name starts with ``prefix``, assembled on every rank of ``group`` from the
    pieces each rank owns (a collective; for small models, tests and exports: it moves everything through
    ``all_gather_object``). Keys lose the prefix."""
    mine = [({**asdict(p), "dtype": str(t.dtype)}, t.detach().reshape(-1).to("cpu").clone())
            for p, t in pieces if p.owner and p.name.startswith(prefix)]
    everyone = comm.all_gather_object(mine, group) if group is not None else [mine]
    by_name: dict[str, list] = {}
    for items in everyone:
        for rec, data in items:
            by_name.setdefault(rec["name"], []).append((rec, data))
    return {n[len(prefix):]: _assemble(n, items) for n, items in sorted(by_name.items())}


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
