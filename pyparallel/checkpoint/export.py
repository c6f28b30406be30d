"""Exports of a checkpoint's model weights, streamed: a Hugging Face folder (:func:`export_pretrained`) or one
safetensors file (:func:`export_consolidated`). One process, no collectives, any saving layout.

Design (issue 13, "exports never gather the whole model on one rank"): every output file's header is planned
from the manifest alone (each tensor's global shape and dtype are recorded there), so the safetensors header
is written first and the data after it one tensor at a time, each assembled from its saved pieces, written and
dropped. The exporting process therefore holds one assembled tensor (plus the piece being placed into it) --
less than the "one output shard plus one tensor" the issue allows -- whatever the model's size.

The safetensors layout written here is the format's specification (an 8-byte little-endian header length, a
JSON header of ``{name: {dtype, shape, data_offsets}}`` plus ``__metadata__`` padded with spaces to 8 bytes,
then the tensors' bytes back to back), produced directly so that no shard is ever staged in memory.
"""

from __future__ import annotations

import json
import os
import re
import struct

import torch

from pyparallel.checkpoint.format import CheckpointError, _assemble, read_manifest, require_all_files

PREFIX = "model/"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# safetensors' dtype names (the format's specification)
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
           torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """Bytes from ``size``: a positive int, or a string as ``save_pretrained`` takes (``"2GB"`` = 2·10⁹,
    ``"500MiB"`` = 500·2²⁰, ``"20KB"``); ValueError naming the value otherwise."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper()) if isinstance(size, str) else None
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"max_shard_size {size!r} is not a size: give bytes (an int) or a string such as "
                             f"'2GB', '500MB', '20KB' or '1GiB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


# ------------------------------------------------------------------------------------- the streaming core


class _Source:
    """The ``model/`` tensors of one checkpoint folder: shapes and dtypes from the manifest, data assembled
    on demand, one tensor at a time (each piece read, placed and released before the next is read)."""

    def __init__(self, root: str, verify: bool = True, prefix: str = PREFIX):
        from pyparallel.checkpoint.store import resolve

        if os.path.isdir(root) and not os.path.exists(os.path.join(root, "manifest.json")) and (
                os.path.exists(os.path.join(root, INDEX)) or os.path.exists(os.path.join(root, SINGLE))):
            raise CheckpointError(f"{root!r} is a Hugging Face weights folder, not a pyparallel checkpoint (no "
                                  f"manifest.json); it needs no export")
        self.folder = resolve(root)
        self.manifest = read_manifest(self.folder, verify=verify)
        require_all_files(self.folder, self.manifest, "an export")
        self.records: dict[str, list[dict]] = {}
        for rec in self.manifest["pieces"]:
            if rec["name"].startswith(prefix):
                self.records.setdefault(rec["name"][len(prefix):], []).append(rec)
        if not self.records:
            raise CheckpointError(f"checkpoint {self.folder!r} holds no tensors named '{prefix}...'")
        self.prefix = prefix

    def names(self) -> list[str]:
        return list(self.records)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.records[name][0]["global_shape"])

    def dtype(self, name: str) -> torch.dtype:
        return getattr(torch, self.records[name][0]["dtype"].replace("torch.", ""))

    def tensor(self, name: str) -> torch.Tensor:
        return _assemble(self.prefix + name, self._pieces(name))

    def _pieces(self, name: str):
        from safetensors import safe_open

        for rec in self.records[name]:
            # Opened per piece and closed before the next: a handle kept open keeps the pages it touched
            # mapped, which would make the whole checkpoint resident in this process by the end.
            with safe_open(os.path.join(self.folder, rec["file"]), framework="pt") as f:
                data = f.get_tensor(rec["key"])
            yield rec, data


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


class _Plan:
    """One output tensor: its name in the file, the checkpoint tensor it comes from, shape and dtype."""

    __slots__ = ("out", "src", "shape", "dtype")

    def __init__(self, out: str, src: str, shape, dtype: torch.dtype):
        if dtype not in _DTYPES:
            raise CheckpointError(f"tensor {src!r} has dtype {dtype}, which safetensors cannot store")
        self.out, self.src, self.shape, self.dtype = out, src, tuple(shape), dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


def _write_file(path: str, plans: list[_Plan], source: _Source) -> None:
    """A safetensors file of ``plans``, streamed: the header from the plan, then each tensor's bytes as it
    is assembled. Written under a temporary name and renamed, so a killed export leaves no partial shard."""
    header, offset = {}, 0
    for p in plans:
        header[p.out] = {"dtype": _DTYPES[p.dtype], "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data that follows starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for p in plans:
            t = source.tensor(p.src)
            if tuple(t.shape) != p.shape:
                raise CheckpointError(f"{p.src}: pieces assemble to shape {tuple(t.shape)}, manifest says {p.shape}")
            t = t.to(p.dtype).contiguous().reshape(-1)
            if t.numel():
                f.write(memoryview(t.view(torch.uint8).numpy()))
            del t
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shards(plans: list[_Plan], limit: int) -> list[list[_Plan]]:
    """``save_pretrained``'s rule: tensors in order; a shard closes when the next tensor would take it past
    ``limit``; a tensor larger than ``limit`` is a shard of its own."""
    out, cur, size = [], [], 0
    for p in plans:
        if cur and size + p.nbytes > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.nbytes
    if cur:
        out.append(cur)
    return out


def _natural(name: str):
    """Sort key that puts ``layers.2`` before ``layers.10`` (the model's order, when nothing better is known)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def _check_out(out: str, what: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{what} {out!r} is a file, not a folder")


# ------------------------------------------------------------------------------------------ HF config


def hf_config_of(model) -> dict | None:
    """The Hugging Face config (as a JSON dict) of ``model`` or of the module a wrapper holds (``.module``,
    through DataParallel / ZeRO / parallelize), or None: what :func:`pyparallel.checkpoint.save` records."""
    for _ in range(4):
        cfg = getattr(model, "config", None)
        if cfg is not None and hasattr(cfg, "to_json_string") and getattr(cfg, "model_type", None):
            return json.loads(cfg.to_json_string(use_diff=False))
        model = getattr(model, "module", None)
        if model is None:
            return None
    return None


def _read_config_path(path: str) -> dict | None:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not (path.endswith(".json") and os.path.isfile(path)):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _config(config, manifest: dict):
    """A transformers config from ``config=`` (a PretrainedConfig, a dict, or a path to a config.json or its
    folder), else from the manifest (``hf_config``, recorded by save; ``extra['hf_config']`` or
    ``extra['config']``; ``extra['model']`` naming a config.json or folder, as ``pyparallel train`` records
    its ``--model``), else None."""
    raw = None
    if config is not None:
        if hasattr(config, "to_json_string"):
            return config
        if isinstance(config, dict):
            raw = config
        elif isinstance(config, (str, os.PathLike)):
            raw = _read_config_path(config)
            if raw is None:
                raise ValueError(f"config {config!r} is neither a config.json nor a folder holding one")
        else:
            raise ValueError(f"config must be a transformers config, a dict or a path, got {type(config).__name__}")
    else:
        extra = manifest.get("extra") or {}
        raw = manifest.get("hf_config") or extra.get("hf_config") or extra.get("config")
        if raw is None and isinstance(extra.get("model"), str):
            raw = _read_config_path(extra["model"])
        if not isinstance(raw, dict):
            return None
    import transformers

    raw = dict(raw)
    try:
        return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"the Hugging Face config is not one this transformers reads: {type(exc).__name__}: "
                         f"{exc}") from None


def _hf_names(config, source: _Source) -> list[tuple[str, str]]:
    """(name in the export, name in the checkpoint) in the order ``save_pretrained`` writes them: the model's
    persistent tensors (its ``state_dict``), a tied weight once under its source name (``_tied_weights_keys``'
    target dropped, as transformers' ``remove_tied_weights_from_state_dict`` does), non-persistent buffers
    (rotary ``inv_freq``) left out. Learnt from the model built on the meta device: no memory."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    metas = model.state_dict(keep_vars=True)
    keys = list(metas)
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    targets = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    drop, alias_of = set(), {}
    for names in groups.values():
        if len(names) < 2:
            continue
        keep = next((n for n in names if n not in targets), names[0])
        drop.update(n for n in names if n != keep)
        alias_of[keep] = names
    stored = set(source.names())
    pairs, missing, wrong = [], [], []
    for key in keys:
        if key in drop:
            continue
        src = next((n for n in alias_of.get(key, [key]) if n in stored), None)
        if src is None:
            missing.append(key)
            continue
        shape = tuple(metas[key].shape)
        if source.shape(src) != shape:
            wrong.append(f"{src} {source.shape(src)} (config: {shape})")
        pairs.append((key, src))
    persistent = set(keys)
    known = {n for names in groups.values() for n in names} | set(n for n, _ in model.named_buffers())
    unexpected = sorted(n for n in stored if n not in known and n not in persistent)
    problems = [f"{len(v)} tensor(s) {w}: {', '.join(v[:5])}" for w, v in
                (("missing", missing), ("not in the model", unexpected), ("with the wrong shape", wrong)) if v]
    if problems:
        raise CheckpointError(f"checkpoint {source.folder!r} does not fit its Hugging Face config "
                              f"({type(model).__name__}): " + "; ".join(problems))
    return pairs


# ---------------------------------------------------------------------------------------------- exports


def export_pretrained(root: str, out_dir: str, *, max_shard_size="2GB", config=None, dtype: torch.dtype | None = None,
                      verify: bool = True) -> dict:
    """Write the model of checkpoint ``root`` (a step folder or a root with ``latest``) as a Hugging Face
    folder that ``from_pretrained`` loads: ``model-0000k-of-0000n.safetensors`` shards of at most
    ``max_shard_size`` (a single tensor larger than that is a shard of its own) and
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), or one ``model.safetensors``
    when everything fits in one shard, as ``save_pretrained`` does; plus ``config.json`` when a Hugging Face
    config is known (``config=``, or recorded in the checkpoint: see :func:`_config`).

    Names are the model's own (``model/`` prefix stripped). With a config, the tensors and their order are
    those ``save_pretrained`` writes (tied weights once, non-persistent buffers left out) and a checkpoint
    that does not fit the config is a CheckpointError naming the tensors; without one, every model tensor of
    the checkpoint is written (buffers included). ``dtype`` converts floating tensors (e.g. bf16 for
    release); None keeps the saved dtype (fp32 masters). Streams one tensor at a time (module docstring).
    Returns the index (``{"metadata": ..., "weight_map": ...}``), also for a single file."""
    limit = parse_size(max_shard_size)
    _check_out(out_dir, "out_dir")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    source = _Source(root, verify)
    if os.path.exists(out_dir) and os.path.samefile(out_dir, source.folder):
        raise ValueError(f"out_dir {out_dir!r} is the checkpoint folder itself; export into another folder")
    cfg = _config(config, source.manifest)
    pairs = _hf_names(cfg, source) if cfg is not None else [(n, n) for n in sorted(source.names(), key=_natural)]

    def out_dtype(src):
        d = source.dtype(src)
        return dtype if dtype is not None and d.is_floating_point else d

    plans = [_Plan(out, src, source.shape(src), out_dtype(src)) for out, src in pairs]
    shards = _shards(plans, limit)
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    os.makedirs(out_dir, exist_ok=True)
    for entry in os.listdir(out_dir):  # weights of an earlier export that this one does not replace
        if (entry in (SINGLE, INDEX) or _SHARD.match(entry)) and entry not in names:
            os.remove(os.path.join(out_dir, entry))
    for name, shard in zip(names, shards):
        _write_file(os.path.join(out_dir, name), shard, source)
    index = {"metadata": {"total_size": sum(p.nbytes for p in plans),
                          "total_parameters": sum(p.nbytes // torch.empty((), dtype=p.dtype).element_size()
                                                  for p in plans)},
             "weight_map": {p.out: name for name, shard in zip(names, shards) for p in shard}}
    if n > 1:
        _write_json(os.path.join(out_dir, INDEX), index)
    if cfg is not None:
        if dtype is not None:
            cfg.dtype = dtype
        cfg.save_pretrained(out_dir)
    return index


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def export_consolidated(root: str, out_file: str, prefix: str = PREFIX) -> list[str]:
    """Write the model's full tensors of checkpoint ``root`` into one safetensors file (keys without the
    ``model/`` prefix, as ``load_state_dict`` of the unparallelised model expects; buffers included).
    Streamed like :func:`export_pretrained`. Returns the keys."""
    if os.path.isdir(out_file):
        raise ValueError(f"out_file {out_file!r} is a folder; give a file name such as model.safetensors")
    source = _Source(root, prefix=prefix)
    names = sorted(source.names())
    _write_file(out_file, [_Plan(n, n, source.shape(n), source.dtype(n)) for n in names], source)
    return names
