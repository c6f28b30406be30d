"""Model weights from safetensors files and Hugging Face checkpoint folders, read piece by piece.

A sharded rank needs only its pieces of each tensor (``format.Piece``: a box of the global tensor and a
flat range in it). :class:`WeightsReader` offers the same calls as a pyparallel checkpoint's reader
(``names``, ``has``, ``full``, ``piece``), with every tensor under ``model/<name>``, so the engines' own
loaders (``zero/pieces.py``, ``checkpoint/modules.py``) read a Hugging Face folder exactly as they read a
checkpoint. Each piece is read through safetensors' ``safe_open(...).get_slice``: only the box's rows are
read from the file, so a rank holds its shard plus one box in flight, never the whole tensor of another
rank. Stored dtypes are converted by the copy into the rank's tensor (a bf16 checkpoint into fp32 masters).

safetensors maps the file, and the file pages a read touches count in the process's resident set for as long
as the mapping lives (it returns tensors over the mapping). The reader therefore opens the file for each
read and keeps no handle: the pages go with the piece once the loader has copied it. (A reader that kept one
handle per file held every page it had read until it was dropped -- at 152.8M parameters, ~300 MiB on a TP
rank, which the wrapper kept for the model's lifetime.)

Accepted: a ``.safetensors`` file, a folder with ``model.safetensors``, or a folder with
``model.safetensors.index.json`` and the shards it names (``save_pretrained``'s layouts).
"""

from __future__ import annotations

import json
import os

import torch

from pyparallel.checkpoint.format import Piece, _numel

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _files_of(path: str) -> dict[str, str]:
    """tensor name -> file, validated: ValueError naming the file for anything unreadable or missing."""
    from safetensors import safe_open

    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): "
                                 f"{exc}") from None
            files = {name: os.path.join(path, file) for name, file in weight_map.items()}
            missing = sorted({f for f in files.values() if not os.path.exists(f)})
            if missing:
                raise ValueError(f"{index} names shard(s) that do not exist: "
                                 f"{', '.join(os.path.basename(m) for m in missing[:5])}")
            for file in sorted(set(files.values())):
                _probe(file)
            return files
        single = os.path.join(path, SINGLE)
        if not os.path.exists(single):
            raise ValueError(f"{path} holds neither {INDEX} nor {SINGLE}: not a Hugging Face checkpoint folder")
        path = single
    if not os.path.exists(path):
        raise ValueError(f"weights file {path} does not exist")
    _probe(path)
    with safe_open(path, framework="pt") as f:
        return {name: path for name in f.keys()}


def _probe(file: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
        raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None


class WeightsReader:
    """Reads pieces of the tensors of a safetensors file or folder (see the module docstring)."""

    prefix = "model/"

    def __init__(self, path: str):
        self.path = path
        self._files = _files_of(path)
        self._shapes: dict[str, tuple[int, ...]] = {}  # from the headers, one file at a time
        self._stored_as: dict[str, str] = {}  # canonical name -> the tied alias the file stores it under

    def _handle(self, file: str):
        """A fresh handle on ``file`` (a mapping of it): dropped with the tensors read through it, which
        releases the pages they touched (see the module docstring). Opening costs ~0.1 ms."""
        from safetensors import safe_open

        return safe_open(file, framework="pt")

    def tensor_names(self) -> list[str]:
        return sorted(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            file = self._files[name]
            handle = self._handle(file)
            for key in handle.keys():
                if self._files.get(key) == file:
                    self._shapes[key] = tuple(handle.get_slice(key).get_shape())
        if name not in self._shapes:  # the index names a tensor its file lacks: safetensors' own error
            return tuple(self._handle(self._files[name]).get_slice(name).get_shape())
        return self._shapes[name]

    def resolve_aliases(self, aliases: dict[str, str]) -> None:
        """Read a tied parameter stored only under another of its names (``lm_head.weight``)."""
        for alias, canonical in aliases.items():
            if canonical not in self._files and alias in self._files:
                self._stored_as[canonical] = alias

    def _key(self, name: str) -> str:
        key = name[len(self.prefix):]
        return self._stored_as.get(key, key)

    def names(self):
        return [self.prefix + n for n in [*self._files, *self._stored_as]]

    def has(self, name: str) -> bool:
        return name.startswith(self.prefix) and self._key(name) in self._files

    def full(self, name: str) -> torch.Tensor:
        key = self._key(name)
        return self._handle(self._files[key]).get_tensor(key)

    def piece(self, piece: Piece) -> torch.Tensor:
        """The piece's flat data: its box read from the file (only those rows), permuted, then the range."""
        key = self._key(piece.name)
        sl = self._handle(self._files[key]).get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != piece.global_shape:
            raise ValueError(f"{self.path}: tensor {key!r} has shape {shape}, the model expects "
                             f"{piece.global_shape}")
        offsets, sizes, start = list(piece.box_offsets), list(piece.box_shape), piece.flat_start
        row = _numel(sizes[1:]) if sizes else 0
        if not piece.perm and row > 0 and sizes[0] > 1:
            # A flat range (a ZeRO shard) covers only some rows of its box: read those rows, not the box --
            # otherwise every rank would read (and hold for a moment) the whole of a large tensor such as
            # the embedding, of which it keeps a quarter.
            first, last = start // row, -(-(start + piece.flat_len) // row)
            offsets[0] += first
            sizes[0] = max(last - first, 0)
            start -= first * row
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        box = sl[index] if index else sl[:]
        if piece.perm:
            box = box.permute(*piece.perm)
        return box.reshape(-1)[start:start + piece.flat_len]


def check_keys(reader: WeightsReader, expected: dict[str, tuple[int, ...]], aliases: dict[str, str]) -> None:
    """ValueError listing (the first few) missing, unexpected and mis-shaped tensors. ``expected``: the
    model's canonical parameter (and persistent buffer) names and shapes; ``aliases``: other names of a
    tied parameter (``lm_head.weight`` -> ``model.embed_tokens.weight``), accepted in either place."""
    stored = set(reader.tensor_names())
    missing = [n for n in expected if n not in stored and not any(a in stored for a, c in aliases.items() if c == n)]
    unexpected = [n for n in sorted(stored) if n not in expected and n not in aliases]
    wrong = [f"{n} {reader.shape(n)} (model: {tuple(expected[n])})" for n in expected
             if n in stored and reader.shape(n) != tuple(expected[n])]
    problems = []
    for what, items in (("missing", missing), ("unexpected", unexpected), ("with the wrong shape", wrong)):
        if items:
            shown = ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")
            problems.append(f"{len(items)} tensor(s) {what}: {shown}")
    if problems:
        raise ValueError(f"weights {reader.path} do not fit the model: " + "; ".join(problems))


def open_weights(path: str, model: torch.nn.Module) -> WeightsReader:
    """A reader of ``path`` checked against ``model`` (names, shapes; tied aliases resolved), or ValueError."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"weights must be a path to a safetensors file or Hugging Face folder, got {path!r}")
    reader = WeightsReader(os.fspath(path))
    expected, aliases = expected_of(model)
    check_keys(reader, expected, aliases)
    reader.resolve_aliases(aliases)
    return reader


def expected_of(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(canonical name -> shape for parameters and persistent buffers, alias -> canonical name)."""
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    canonical = {id(p): n for n, p in model.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
               if canonical[id(p)] != n}
    for mod_name, mod in model.named_modules():
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                expected[f"{mod_name}.{b_name}" if mod_name else b_name] = tuple(b.shape)
    return expected, aliases
