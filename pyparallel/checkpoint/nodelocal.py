"""Checkpoints in per-node local folders (``storage="node-local"``): each node keeps its own ranks' pieces.

The default storage (:mod:`~pyparallel.checkpoint.store`) is one folder every node sees. With
``save(..., storage="node-local")`` the root path names a folder on each node's own disk instead, and:

* **Who shares a folder is measured, not assumed.** Every rank drops a probe file into its root; ranks
  that see each other's probes form one *storage node* (in practice one machine, i.e. one torchrun node;
  nodes that happen to share a filesystem form one storage node, and the save is then an ordinary shared
  one for them). Each storage node has a leader, its lowest global rank (torchrun's local rank 0).
* **Each storage node holds everything its ranks need to resume in the same layout.** Every element is
  still written once canonically (by the rank that writes it in a shared save), into that rank's node. A
  piece that a rank holds but whose canonical writer is on another node (a data-parallel replica, a
  ZeRO-0 copy) is also written, as a *copy*, by the lowest rank of the node that holds it; small whole
  tensors (at most :data:`SMALL` elements: Adam's ``step`` per parameter, the loss scaler) are copied to
  every node by its leader, because any rank's loader may ask for them.
* **Every leader writes the manifest of its node**: all canonical pieces of the save with the file (and
  so the node) that holds each, this node's copies, every file's checksum and node, and for each node its
  ranks, hostnames and boot ids, plus a save id shared by every node's copy. Each leader commits its
  folder exactly as a shared save does (fsync, rename, ``latest``); older copies of the same step are
  removed only after every node has committed, so a crash between two nodes' commits leaves a save that
  is complete on every node.
* **A load checks collectively, before reading anything**, that every rank's node folder holds the same
  save and every piece the rank needs (its layout's model and optimizer pieces), and otherwise raises the
  same :class:`CheckpointError` on every rank, naming the pieces, the rank that needs them and the node
  (host and ranks) whose folder holds them. So loading on the layout and nodes that saved works; a
  different layout, or ranks that landed on other nodes, works only where the node's own folder covers it.
* :func:`newest_common` is what ``pyparallel train --resume`` uses: the newest save complete on every node.

Copying every node's ``rank-*.safetensors`` of one save into one folder (next to any node's manifest)
makes an ordinary checkpoint: the default load, ``read_tensors`` and the exports read it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from dataclasses import asdict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pyparallel.checkpoint import store
from pyparallel.checkpoint.export import hf_config_of
from pyparallel.checkpoint.format import (
    FORMAT,
    VERSION,
    CheckpointError,
    Piece,
    _cut,
    _numel,
    _place,
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

STORAGE = "node-local"
SMALL = 64  # whole tensors of at most this many elements are copied to every node
_PROBE = ".tmp-probe-"
_LIST = 6  # how many missing pieces an error lists


def _key(p: Piece) -> tuple:
    return (p.name, p.global_shape, p.box_offsets, p.box_shape, p.flat_start, p.flat_len, p.perm)


def _rec_key(rec: dict) -> tuple:
    perm = rec.get("perm")
    return (rec["name"], tuple(rec["global_shape"]), tuple(rec["box_offsets"]), tuple(rec["box_shape"]),
            rec["flat_start"], rec["flat_len"], tuple(perm) if perm is not None else None)


def _is_whole(p: Piece) -> bool:
    return (p.box_shape == p.global_shape and not any(p.box_offsets) and p.flat_start == 0
            and p.flat_len == _numel(p.global_shape) and (p.perm is None or p.perm == tuple(range(len(p.perm)))))


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def node_text(manifest: dict, index: int) -> str:
    """``node 1 (node1; ranks 2, 3)``: a storage node of ``manifest`` by its hosts and global ranks."""
    node = manifest["nodes"][index]
    return f"node {index} ({', '.join(node['hosts'])}; ranks {_ranks_text(node['ranks'])})"


def _region(p: Piece) -> str:
    if _is_whole(p):
        return "whole"
    box = "x".join(f"{o}:{o + s}" for o, s in zip(p.box_offsets, p.box_shape))
    full = p.flat_start == 0 and p.flat_len == _numel(p.box_shape)
    return f"[{box}]" + ("" if full else f" elements {p.flat_start}:{p.flat_start + p.flat_len}")


# ----------------------------------------------------------------------------------------------- save


def save(root: str, model, optimizer, *, step: int, extra: dict | None, mesh, group, rank: int, world: int) -> str:
    """``store.save(..., storage="node-local")``: six phases, each ending in an exchange that raises an error
    of any rank on every rank (as the shared save's three)."""
    what = f"checkpoint.save of step {step} into {root!r} (node-local)"
    tmp_name = f".tmp-step-{step:08d}"
    tmp = os.path.join(root, tmp_name)
    started = time.time()
    host = socket.gethostname()
    probe = f"{_PROBE}{uuid.uuid4().hex}"
    pieces = _module_pieces(model) + (_optimizer_pieces(model, optimizer) if optimizer is not None else [])
    canonical = [p.owner if p.owner is not None else rank == 0 for p, _ in pieces]
    store._kill_point("start")

    def identify():
        if os.path.exists(root) and not os.path.isdir(root):
            raise CheckpointError(f"checkpoint root {root!r} is a file, not a folder")
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, probe), "w"):
            pass
        small = [(asdict(p), t.detach().reshape(-1).to("cpu").clone())
                 for (p, t), c in zip(pieces, canonical) if c and _is_whole(p) and p.flat_len <= SMALL]
        return {"host": host, "boot": _boot_id(), "path": os.path.abspath(root), "probe": probe,
                "save": uuid.uuid4().hex, "time": time.time(), "small": small,
                "held": [(_key(p), c) for (p, _), c in zip(pieces, canonical)]}

    ids = store._exchange(group, what, "identifying the nodes", identify)
    # Ranks on one host that name the same path see one folder (they are checked, not trusted: each looks
    # for its representative's probe); representatives of different classes look for each other's probes.
    classes: dict[tuple, list[int]] = {}
    for r, info in enumerate(ids):
        classes.setdefault((info["host"], info["boot"], info["path"]), []).append(r)
    rep_of = {r: members[0] for members in classes.values() for r in members}
    reps = sorted(set(rep_of.values()))

    def look():
        if rep_of[rank] != rank:
            rep = rep_of[rank]
            if not os.path.exists(os.path.join(root, ids[rep]["probe"])):
                raise CheckpointError(f"rank {rank} ({host}) does not see the file rank {rep} on the same host "
                                      f"created in {root!r} under the same path: the two processes see different "
                                      f"folders there (separate mount namespaces?)")
            return None
        return [q for q in reps if q == rank or os.path.exists(os.path.join(root, ids[q]["probe"]))]

    seen = store._exchange(group, what, "finding which ranks share a folder", look)
    nodes = _storage_nodes(root, reps, {q: set(seen[q]) for q in reps}, rep_of, ids)
    node_of = {r: k for k, ranks in enumerate(nodes) for r in ranks}
    mine = node_of[rank]
    leader = nodes[mine][0]

    def prepare():
        try:
            os.remove(os.path.join(root, probe))
        except OSError:
            pass
        return store._prepare(root, tmp, step) if rank == leader else None

    names = store._exchange(group, what, "preparing the folder", prepare)
    store._kill_point("prepared")

    def write():
        return _write(pieces, canonical, ids, nodes[mine], rank, leader, tmp, host)

    everyone = store._exchange(group, what, "writing its pieces", write)
    store._kill_point("written")
    save_id, save_time = ids[0]["save"], ids[0]["time"]

    def commit():
        if rank != leader:
            return None
        manifest = {
            "format": FORMAT, "version": VERSION, "step": step, "extra": extra or {}, "world_size": world,
            "layout": store._layout(mesh), "storage": STORAGE, "save": {"id": save_id, "time": save_time},
            "node": mine, "hosts": [info["host"] for info in ids],
            "nodes": [{"ranks": ranks, "hosts": sorted({ids[r]["host"] for r in ranks}),
                       "boot_ids": sorted({ids[r]["boot"] for r in ranks})} for ranks in nodes],
            "files": {}, "pieces": [], "copies": [],
            "optimizer_groups": _optimizer_groups(optimizer) if optimizer is not None else None,
        }
        hf_config = hf_config_of(model)
        if hf_config is not None:
            manifest["hf_config"] = hf_config
        for r, (recs, copies, files) in enumerate(everyone):
            manifest["pieces"].extend(recs)
            if node_of[r] == mine:
                manifest["copies"].extend(copies)
            manifest["files"].update({f: {**meta, "node": node_of[r]} for f, meta in files.items()})
        ours = [f for f, meta in manifest["files"].items() if meta["node"] == mine]
        unseen = sorted(f for f in ours if not os.path.exists(os.path.join(tmp, f)))
        if unseen:
            raise CheckpointError(f"rank {rank} ({host}), the leader of its node, does not see "
                                  f"{', '.join(unseen[:4])} that ranks of its node wrote into {tmp!r}")
        store._commit(root, tmp, names[leader], step, manifest, started, cleanup=False)
        return None

    store._exchange(group, what, "committing", commit)

    def clean():  # only now that every node has committed: a crash before this leaves a common save
        if rank == leader:
            store._remove_replaced(root, names[leader], step, started)
            for entry in store._listdir(root):
                path = os.path.join(root, entry)
                try:
                    if entry.startswith(_PROBE) and os.path.getmtime(path) < started:
                        os.remove(path)
                except OSError:
                    pass
        return None

    store._exchange(group, what, "removing what it replaced", clean)
    store._kill_point("done")
    return os.path.join(root, names[leader])


def _storage_nodes(root, reps, views, rep_of, ids) -> list[list[int]]:
    """The storage nodes (lists of global ranks, ordered by lowest rank) from which representatives see
    which probes; a CheckpointError when the views do not form groups that each see all of their members."""
    groups = []
    for q in reps:
        if any(q in g for g in groups):
            continue
        if any(views[m] != views[q] for m in views[q]):
            found = "; ".join(f"rank {m} ({ids[m]['host']}) sees the files of ranks {sorted(views[m])}"
                              for m in reps)
            raise CheckpointError(f"the ranks do not agree on which of them share the folder {root!r} ({found}); "
                                  f"a filesystem whose directory listings lag (a network filesystem's "
                                  f"attribute cache) or folders mounted differently on one node can do this")
        groups.append(views[q])
    return [sorted(r for r in rep_of if rep_of[r] in g) for g in groups]


def _write(pieces, canonical, ids, node: list[int], rank: int, leader: int, tmp: str, host: str):
    """This rank's file: its canonical pieces, the copies its node needs from it (see the module
    docstring), and on the leader the small whole tensors no rank of the node holds canonically."""
    ours = set()
    for r in node:
        ours.update(k for k, c in ids[r]["held"] if c)
    small = {}
    for info in ids:
        for rec, data in info["small"]:
            small.setdefault(_rec_key(rec), (rec, data))
    first_holder = {}
    for r in node:
        for k, _ in ids[r]["held"]:
            first_holder.setdefault(k, r)
    fname = f"rank-{rank:05d}.safetensors"
    tensors, records, copies = {}, [], []

    def add(piece_rec: dict, flat: torch.Tensor, out: list) -> None:
        key = f"{len(tensors):06d}"
        tensors[key] = flat.clone()
        out.append({**piece_rec, "key": key, "file": fname, "dtype": str(flat.dtype)})

    done = set()
    for (piece, tensor), c in zip(pieces, canonical):
        k = _key(piece)
        flat = tensor.detach().reshape(-1).to("cpu").contiguous()
        if flat.numel() != piece.flat_len:
            raise ValueError(f"checkpoint piece {piece.name}: tensor has {flat.numel()} elements, piece "
                             f"describes {piece.flat_len}")
        if k in done:
            continue
        if c:
            add(asdict(piece), flat, records)
        elif k not in ours and k not in small and first_holder.get(k) == rank:
            add(asdict(piece), flat, copies)
        else:
            continue
        done.add(k)
    if rank == leader:
        for k, (rec, data) in sorted(small.items(), key=lambda kv: kv[1][0]["name"]):
            if k not in ours:
                add(rec, data, copies)
    files = {}
    if tensors:
        if not os.path.isdir(tmp):
            raise CheckpointError(f"rank {rank} ({host}) does not see the folder {tmp!r} that rank {leader}, the "
                                  f"leader of its node, created")
        path = os.path.join(tmp, fname)
        save_file(tensors, path)
        store._fsync_file(path)
        files[fname] = {"sha256": _sha256(path), "bytes": os.path.getsize(path)}
    return records, copies, files


# ----------------------------------------------------------------------------------------------- load


def identity(folder: str, manifest: dict) -> str:
    """What makes two nodes' folders the same save: the save id (node-local), else the manifest's bytes."""
    saved = manifest.get("save")
    if saved and saved.get("id"):
        return saved["id"]
    h = hashlib.sha256()
    with open(os.path.join(folder, "manifest.json"), "rb") as f:
        h.update(f.read())
    return "manifest-" + h.hexdigest()[:16]


def present_files(folder: str, manifest: dict) -> set[str]:
    """The manifest's files that this folder holds (this node's, and any other node's copied here); a
    CheckpointError when one of this node's own files is missing."""
    own = manifest.get("node") if manifest.get("storage") == STORAGE else None
    present = {f for f in manifest["files"] if os.path.exists(os.path.join(folder, f))}
    lost = sorted(f for f, meta in manifest["files"].items()
                  if f not in present and (own is None or meta.get("node") == own))
    if lost:
        raise CheckpointError(f"checkpoint {folder!r} is incomplete: {', '.join(lost[:4])} "
                              f"{'is' if len(lost) == 1 else 'are'} missing")
    return present


class NodeLocalReader:
    """The loaders' reader (``names``, ``has``, ``full``, ``piece``) over the files one folder holds.

    ``piece`` reads, in this order, the canonical piece of exactly that region, this node's copy of it, or
    cuts it from the canonical pieces this folder holds (another layout); a piece the folder lacks is
    recorded in :attr:`misses` and given as zeros, so that every rank runs its loaders (and their
    collectives) to the end before all raise together. ``full`` of a tensor this folder holds only part of
    returns a *meta* tensor (its shape and dtype, no values: the loaders ask for shapes; any value read
    from it fails); the values a rank loads come through ``piece``."""

    def __init__(self, folder: str, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        self.present = present_files(folder, manifest)
        self.by_name: dict[str, list[dict]] = {}
        for rec in manifest["pieces"]:
            self.by_name.setdefault(rec["name"], []).append(rec)
        self.local: dict[str, list[dict]] = {}
        self.exact: dict[tuple, dict] = {}
        for rec in manifest["pieces"]:
            if rec["file"] in self.present:
                self.local.setdefault(rec["name"], []).append(rec)
                self.exact.setdefault(_rec_key(rec), rec)
        self.copies: dict[tuple, dict] = {}
        self.copy_names: dict[str, dict] = {}
        for rec in manifest.get("copies", []):
            if rec["file"] in self.present:
                self.copies.setdefault(_rec_key(rec), rec)
                self.copy_names.setdefault(rec["name"], rec)
        self._cache: tuple[str, torch.Tensor, torch.Tensor] | None = None
        self._mask: tuple[str, torch.Tensor] | None = None
        self.misses: list[str] = []  # pieces asked for that this folder lacks (given as zeros)

    # --------------------------------------------------------------------- what the loaders call
    def names(self):
        return list(self.by_name.keys() | self.copy_names.keys())

    def has(self, name: str) -> bool:
        return name in self.by_name or name in self.copy_names

    def shape(self, name: str) -> tuple[int, ...]:
        rec = (self.by_name.get(name) or [self.copy_names.get(name)])[0]
        return tuple(rec["global_shape"])

    def full(self, name: str) -> torch.Tensor:
        if not self.has(name):
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        recs = self.by_name.get(name, [])
        local = self.local.get(name, [])
        if recs and (len(local) == len(recs) or any(_is_whole(_piece_of(r)) for r in local)):
            return self._assembled(name)[0]
        shape = self.shape(name)
        whole = self.copies.get((name, shape, (0,) * len(shape), shape, 0, _numel(shape), None))
        if whole is not None:
            return self._get(whole).view(shape)
        rec = (recs or [self.copy_names[name]])[0]
        return torch.empty(shape, dtype=_dtype(rec), device="meta")

    def piece(self, piece: Piece) -> torch.Tensor:
        k = _key(piece)
        rec = self.exact.get(k) or self.copies.get(k)
        if rec is not None:
            return self._get(rec)
        if self.local.get(piece.name) and bool(_cut(self._local_mask(piece.name), piece).all()):
            return _cut(self._assembled(piece.name)[0], piece)
        if not self.has(piece.name):
            raise CheckpointError(f"checkpoint has no tensor {piece.name!r}")
        self.misses.append(self.missing(piece) or f"{piece.name} {_region(piece)}")
        return torch.zeros(piece.flat_len, dtype=_dtype((self.by_name.get(piece.name) or
                                                         [self.copy_names[piece.name]])[0]))

    # ------------------------------------------------------------------------------- the check
    def missing(self, piece: Piece) -> str | None:
        """None when this folder can give ``piece`` (or the checkpoint lacks the tensor altogether: the
        loader decides whether that is an error), else what is missing and which node holds it."""
        if not self.has(piece.name):
            return None
        shape = self.shape(piece.name)
        if shape != piece.global_shape:
            return f"{piece.name} was saved with shape {shape}, the model now has {piece.global_shape}"
        k = _key(piece)
        if k in self.exact or k in self.copies:
            return None
        if self.local.get(piece.name):
            have = _cut(self._local_mask(piece.name), piece)
            if bool(have.all()):
                return None
        else:
            have = torch.zeros(piece.flat_len, dtype=torch.bool)
        # Which files (nodes) hold the elements this folder lacks.
        elsewhere = [r for r in self.by_name.get(piece.name, []) if r["file"] not in self.present]
        files = sorted({r["file"] for r in elsewhere})
        owner = torch.full(shape, -1, dtype=torch.int32)
        for rec in elsewhere:
            _place(owner, rec, torch.full((rec["flat_len"],), files.index(rec["file"]), dtype=torch.int32))
        found = _cut(owner, piece)[~have]
        held = [files[i] for i in sorted(set(found.tolist())) if i >= 0]
        where = "; ".join(f"{f} on {node_text(self.manifest, self.manifest['files'][f]['node'])}"
                          if "node" in self.manifest["files"][f] else f for f in held[:3])
        gap = " (and some elements no saved piece covers)" if bool((found < 0).any()) else ""
        return f"{piece.name} {_region(piece)}: in {where or 'no saved piece'}{gap}"

    # ----------------------------------------------------------------------------------- reading
    def _get(self, rec: dict) -> torch.Tensor:
        with safe_open(os.path.join(self.folder, rec["file"]), framework="pt") as f:
            return f.get_tensor(rec["key"])

    def _local_mask(self, name: str) -> torch.Tensor:
        if self._mask is not None and self._mask[0] == name:
            return self._mask[1]
        self._mask = None
        mask = torch.zeros(self.shape(name), dtype=torch.bool)
        for rec in self.local.get(name, []):
            _place(mask, rec, torch.ones(rec["flat_len"], dtype=torch.bool))
        self._mask = (name, mask)
        return mask

    def _assembled(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is not None and self._cache[0] == name:
            return self._cache[1], self._cache[2]
        self._cache = None  # the previous tensor is not kept alive while this one is assembled
        recs = self.local[name]
        out = torch.empty(self.shape(name), dtype=_dtype(recs[0]))
        for rec in recs:
            _place(out, rec, self._get(rec))
        self._cache = (name, out, self._local_mask(name))
        return out, self._cache[2]


def _piece_of(rec: dict) -> Piece:
    return Piece(rec["name"], rec["global_shape"], rec["box_offsets"], rec["box_shape"], rec["flat_start"],
                 rec["flat_len"], perm=rec.get("perm"))


def _dtype(rec: dict) -> torch.dtype:
    return getattr(torch, rec["dtype"].replace("torch.", ""))


def needed(model, optimizer) -> list[Piece]:
    """The pieces this rank describes (its model's and, once it has state, its optimizer's): what the
    loaders read back in the same layout. What they read beyond these (another layout, a fresh optimizer's
    state) is checked as it is read (:attr:`NodeLocalReader.misses`)."""
    out = [p for p, _ in _module_pieces(model)]
    if optimizer is not None:
        out += [p for p, _ in _optimizer_pieces(model, optimizer)]
    unique = {}
    for p in out:
        unique.setdefault(_key(p), p)
    return sorted(unique.values(), key=lambda p: p.name)


@torch.no_grad()
def load(root: str, model, optimizer, *, mesh, verify: bool) -> dict:
    """``store.load(..., storage="node-local")``: each rank opens its own node's copy; one exchange checks
    that all copies are the same save and hold what every rank needs, then each rank reads locally."""
    rank, world = store._rank_world()
    group = mesh.world_group if mesh is not None else None
    if group is None and world > 1:
        raise ValueError(f"checkpoint.load with storage='node-local' on {world} processes needs the mesh "
                         f"(mesh=...): the ranks check together that every piece is on their node")
    what = f"checkpoint.load of {root!r} (node-local)"
    host = socket.gethostname()
    opened = {}

    def open_local():
        try:
            folder = store.resolve(root)
            manifest = read_manifest(folder, verify=verify)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (rank {rank} on {host})") from None
        reader = NodeLocalReader(folder, manifest)
        problems = [m for m in (reader.missing(p) for p in needed(model, optimizer)) if m]
        opened.update(folder=folder, manifest=manifest, reader=reader)
        return {"id": identity(folder, manifest), "folder": os.path.basename(folder), "step": manifest["step"],
                "host": host, "problems": problems[:_LIST], "count": len(problems),
                "layout": manifest.get("layout"), "hosts": manifest.get("hosts"), "node": manifest.get("node")}

    everyone = store._exchange(group, what, "opening its node's checkpoint", open_local)
    saves = {}
    for r, info in enumerate(everyone):
        saves.setdefault((info["id"], info["folder"], info["step"]), []).append(r)
    if len({key[0] for key in saves}) > 1:
        found = "; ".join(f"ranks {_ranks_text(rs)} ({', '.join(sorted({everyone[r]['host'] for r in rs}))}): "
                          f"{name} (step {st})" for (_, name, st), rs in saves.items())
        raise CheckpointError(f"checkpoint.load (node-local): the ranks' folders hold different saves ({found}); "
                              f"every node must load its copy of the same save "
                              f"(pyparallel.checkpoint.newest_common(root, mesh) finds the newest one every node "
                              f"holds)")
    _raise_missing(everyone, mesh, "")
    reader = opened["reader"]
    _load_model(model, reader)
    if optimizer is not None:
        _load_optimizer(model, optimizer, reader, opened["manifest"])
    # A piece the loaders asked for beyond those checked above was given as zeros and recorded: every rank
    # has run the same loaders (and their collectives) to the end, and now all fail together.
    late = store._exchange(group, what, "checking what it read",
                           lambda: {**everyone[rank], "problems": reader.misses[:_LIST], "count": len(reader.misses)})
    _raise_missing(late, mesh, " (the model and optimizer are left partly loaded)")
    manifest = opened["manifest"]
    return {"step": manifest["step"], "extra": manifest["extra"], "layout": manifest["layout"]}


def _raise_missing(everyone: list[dict], mesh, note: str) -> None:
    """The same CheckpointError on every rank when any rank lacks pieces (from the exchanged reports)."""
    head = f"checkpoint.load (node-local) of step {everyone[0]['step']}"
    bad = [(r, info) for r, info in enumerate(everyone) if info["count"]]
    if bad:
        total = sum(info["count"] for _, info in bad)
        lines = []  # the first pieces of every rank in turn, so each rank that lacks some is named
        for i in range(_LIST):
            lines += [f"rank {r} ({info['host']}{_reading(info)}) needs {info['problems'][i]}" for r, info in bad
                      if i < len(info["problems"])]
        shown = "; ".join(lines[:_LIST]) + (f"; ... ({total} pieces in all)" if total > _LIST else "")
        first = everyone[0]
        saved, now_layout = _layout_text(first["layout"]), _layout_text(store._layout(mesh))
        layout = saved if saved == now_layout else f"{saved}; now {now_layout}"
        saved_by = first["hosts"] or []
        now = [info["host"] for info in everyone]
        mapping = "" if saved_by == now else (f"; the ranks were on hosts {_hosts_text(saved_by)} when saved "
                                              f"and are on {_hosts_text(now)} now")
        raise CheckpointError(
            f"{head}: {total} pieces that ranks need are not in their own node's folder{note}: {shown}. A node-local "
            f"checkpoint loads only where each node's folder holds its ranks' pieces: the layout it was saved "
            f"with ({layout}, the same strategy and ZeRO stage) and every rank on the node that saved "
            f"it{mapping}. Copy the other nodes' files of this step into each node's "
            f"folder, or save to a shared folder (the default storage)")


def _reading(info: dict) -> str:
    return "" if info["node"] is None else f", whose folder holds node {info['node']}'s pieces"


def _layout_text(layout) -> str:
    layout = layout or {}
    return " x ".join(f"{k}={layout.get(k, 1)}" for k in ("dp", "tp", "pp"))


def _hosts_text(hosts: list[str]) -> str:
    """``node0 (ranks 0, 1), node1 (ranks 2, 3)``."""
    by = {}
    for r, h in enumerate(hosts):
        by.setdefault(h, []).append(r)
    return ", ".join(f"{h} (ranks {_ranks_text(rs)})" for h, rs in by.items())


# --------------------------------------------------------------------------------------------- resume


def _complete_here(folder: str, manifest: dict) -> bool:
    """Whether this node's files of the save are all there at their recorded sizes (no checksums: load
    verifies them)."""
    own = manifest.get("node") if manifest.get("storage") == STORAGE else None
    for f, meta in manifest["files"].items():
        if own is not None and meta.get("node") != own:
            continue
        path = os.path.join(folder, f)
        if not os.path.isfile(path) or os.path.getsize(path) != meta["bytes"]:
            return False
    return True


def newest_common(root: str, mesh=None) -> str | None:
    """The newest save under ``root`` that is complete on every node, as this rank's own folder of it
    (the folder names may differ between nodes), or None when no rank has any checkpoint there. A
    collective over ``mesh.world_group``. Raises the same CheckpointError on every rank when some nodes
    have checkpoints but none of them is complete on every node (a node with an empty disk would otherwise
    restart from step 0 while the others resume)."""
    rank, world = store._rank_world()
    group = mesh.world_group if mesh is not None else None
    if group is None and world > 1:
        raise ValueError(f"checkpoint.newest_common on {world} processes needs the mesh")
    host = socket.gethostname()
    mine: dict[str, str] = {}

    def survey():
        found = []
        for folder in store.complete_steps(root):
            try:
                manifest = read_manifest(folder, verify=False)
                ident = identity(folder, manifest)
            except (CheckpointError, OSError, KeyError):
                continue
            saved = (manifest.get("save") or {}).get("time") or os.path.getmtime(os.path.join(folder, "manifest.json"))
            mine[ident] = folder
            found.append((ident, manifest["step"], saved, os.path.basename(folder), _complete_here(folder, manifest)))
        return {"host": host, "found": found}

    everyone = store._exchange(group, f"checkpoint.newest_common of {root!r}", "listing its node's checkpoints",
                               survey)
    complete = [{ident for ident, *_, ok in info["found"] if ok} for info in everyone]
    common = set.intersection(*complete)
    if common:
        order = {ident: (step, saved) for ident, step, saved, _, _ in everyone[0]["found"]}
        return mine[max(common, key=lambda i: order[i])]
    if not any(info["found"] for info in everyone):
        return None
    views = {}
    for r, info in enumerate(everyone):
        names = [f"{name}{'' if ok else ' (incomplete)'}" for _, _, _, name, ok in info["found"]][-4:]
        views.setdefault((info["host"], ", ".join(names) or "nothing"), []).append(r)
    found = "; ".join(f"ranks {_ranks_text(rs)} on {h}: {names}" for (h, names), rs in views.items())
    raise CheckpointError(f"no checkpoint under {root!r} is complete on every node ({found}). Node-local "
                          f"checkpoints resume only on the nodes that saved them, each rank on the node it "
                          f"was on; copy a step's files onto the nodes that lack them, or start afresh in "
                          f"another folder")
