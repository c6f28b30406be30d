"""Checkpoint pieces of a DP x TP x PP (+ ZeRO) model: every rank says which part of which *global* tensor
each of its shards is (``pyparallel.checkpoint.Piece``), so a later run in any layout can cut out what it
needs.

Names are the unparallelised model's: ``model/<parameter name>`` for the weights (always from the master
copy, so fp32 even when training in bf16), ``optim/<parameter name>/<state key>`` for optimizer state, the
layout ``checkpoint.py`` uses for plain models and torch optimizers. A ZeRO slice of a flat group is, for
each parameter it overlaps, a flat range of that parameter's TP box(es) (``layout.flat_pieces``). Each
element is written by exactly one rank: the one that counts it in the gradient norm (``DPEngine``).
Per-parameter scalars in the optimizer state (Adam's ``step``) are written by the holder of the
parameter's first element.
"""

from __future__ import annotations

import torch

from pyparallel.checkpoint import CheckpointError, Piece
from pyparallel.combined.layout import ParamInfo, flat_pieces


def _shard_pieces(engine, prefix_of, source: torch.Tensor):
    """(Piece, view of ``source``) for every parameter part in this rank's shard space."""
    out = []
    for info, lo, hi, at, owner in _overlaps(engine):
        for seg, start, length, off in flat_pieces(info, lo, hi):
            piece = Piece(prefix_of(info), info.global_shape, seg.box_offsets, seg.box_shape, start, length,
                          owner=owner, perm=seg.perm)
            out.append((piece, source[at + off:at + off + length]))
    return out


def _overlaps(engine):
    """Per parameter this rank's shard touches: (ParamInfo, [lo, hi) in the local tensor's flat order, the
    shard-space index of lo, whether this rank writes it)."""
    dp_owner = engine.stage >= 1 or engine.mesh.dp_rank == 0
    for g, lay in enumerate(engine.layouts):
        a, b = lay.shard_range(engine.rank)
        base = engine.space.offsets[g]
        for p, o, n in zip(lay.params, lay.offsets, lay.numels):
            lo, hi = max(a, o), min(b, o + n)
            if lo < hi:
                info = engine.infos[id(p)]
                yield info, lo - o, hi - o, base + lo - a, dp_owner and info.counted


def _whole_pieces(info: ParamInfo, tensor: torch.Tensor, name: str, owner: bool):
    flat = tensor.reshape(-1)
    return [(Piece(name, info.global_shape, s.box_offsets, s.box_shape, 0, s.numel, owner=owner, perm=s.perm),
             flat[s.local_start:s.local_start + s.numel]) for s in info.segments]


def model_pieces(pm) -> list[tuple[Piece, torch.Tensor]]:
    """Weights (from the master), frozen parameters and buffers of this rank."""
    eng = pm.engine
    out = _shard_pieces(eng, lambda info: "model/" + info.name, eng.updater.master)
    first = pm.mesh.dp_rank == 0
    for info, p in eng.frozen:
        out += _whole_pieces(info, p.detach(), "model/" + info.name, first and info.counted)
    for name, buf in pm.named_buffers():
        owner = first and pm.mesh.tp_rank == 0
        out.append((Piece("model/" + name, tuple(buf.shape), (0,) * buf.dim(), tuple(buf.shape), owner=owner), buf))
    if eng.scaler is not None:
        state = torch.tensor([eng.scaler.scale, eng.scaler.skipped_steps, eng.scaler.good_steps,
                              eng.scaler._since_growth], dtype=torch.float64)
        out.append((Piece.whole("amp/loss_scaler", (4,)), state))
    return out


@torch.no_grad()
def load_model(pm, reader) -> None:
    eng = pm.engine
    master = eng.updater.master
    for piece, view in _shard_pieces(eng, lambda info: "model/" + info.name, master):
        view.copy_(reader.piece(piece))
    eng.refresh_params()
    for info, p in eng.frozen:
        for piece, view in _whole_pieces(info, p.detach(), "model/" + info.name, True):
            view.copy_(reader.piece(piece))
    for name, buf in pm.named_buffers():
        if reader.has("model/" + name):
            buf.copy_(reader.full("model/" + name).view(buf.shape))
    if eng.scaler is not None and reader.has("amp/loss_scaler"):
        scale, skipped, good, since = reader.full("amp/loss_scaler").tolist()
        eng.scaler.load_state_dict({"scale": scale, "skipped_steps": int(skipped), "good_steps": int(good),
                                    "since_growth": int(since)})


def _state(eng) -> tuple[torch.nn.Parameter, dict]:
    opt = eng.updater.optimizer
    prm = opt.param_groups[0]["params"][0]
    return prm, opt.state.get(prm, {})


def optimizer_pieces(eng) -> list[tuple[Piece, torch.Tensor]]:
    """``optim/<name>/<key>``: element-wise state as shards, per-parameter scalars (Adam's ``step``) once
    per parameter, by the rank that writes the parameter's first element."""
    _, state = _state(eng)
    out = []
    for key, value in state.items():
        if not torch.is_tensor(value):
            continue
        if value.dim() == 1 and value.numel() == eng.space.numel:
            out += _shard_pieces(eng, lambda info, k=key: f"optim/{info.name}/{k}", value)
        elif value.numel() == 1:
            for info, lo, _hi, _at, owner in _overlaps(eng):
                if owner and lo == 0 and _holds_origin(info):
                    out.append((Piece(f"optim/{info.name}/{key}", tuple(value.shape), (0,) * value.dim(),
                                      tuple(value.shape), owner=True), value))
        else:
            raise CheckpointError(f"optimizer state {key!r} has {value.numel()} elements; only element-wise "
                                  f"state (one value per parameter element) and scalars can be resharded")
    return out


def _holds_origin(info: ParamInfo) -> bool:
    """Whether this rank's TP shard of ``info`` starts at the global tensor's first element."""
    seg = info.segments[0]
    return seg.local_start == 0 and all(o == 0 for o in seg.box_offsets)


@torch.no_grad()
def load_optimizer(eng, reader, manifest: dict) -> None:
    """Rebuild this rank's optimizer state from the checkpoint, for its current layout: element-wise state
    (saved with the parameter's global shape) is cut into this rank's shard space, scalars are copied."""
    prm, _ = _state(eng)
    opt = eng.updater.optimizer
    infos = {eng.infos[id(p)].name: eng.infos[id(p)] for lay in eng.layouts for p in lay.params}
    keys = sorted({k.rsplit("/", 1)[1] for k in reader.names()
                   if k.startswith("optim/") and k[len("optim/"):].rsplit("/", 1)[0] in infos})
    state = {}
    for key in keys:
        name = next(n for n in sorted(infos) if reader.has(f"optim/{n}/{key}"))
        sample = reader.full(f"optim/{name}/{key}")
        if tuple(sample.shape) == infos[name].global_shape:
            value = torch.zeros(eng.space.numel, dtype=sample.dtype, device=eng.updater.master.device)
            for piece, view in _shard_pieces(eng, lambda i, k=key: f"optim/{i.name}/{k}", value):
                view.copy_(reader.piece(piece))
        elif sample.numel() == 1:
            value = sample.clone()
        else:
            raise CheckpointError(f"optim/{name}/{key} has shape {tuple(sample.shape)}: neither the parameter's "
                                  f"{infos[name].global_shape} nor a scalar")
        state[key] = value
    if state:
        opt.state[prm] = state
    saved = (manifest.get("optimizer_groups") or [None])[0]
    for k, v in (saved or {}).items():
        if k in opt.param_groups[0] and k != "params":
            opt.param_groups[0][k] = tuple(v) if isinstance(opt.param_groups[0][k], tuple) else v
