"""ZeRO's shards described to ``pyparallel.checkpoint``: the flat ranges of each parameter a rank owns.

A checkpoint stores global tensors as pieces (``checkpoint.Piece``: a box of the global tensor and a flat
range inside it). A ZeRO rank owns, for each parameter that overlaps its slice of a flat group, one
contiguous flat range of that parameter: exactly a piece. So the fp32 master weights are saved as
``model/<name>`` pieces and each per-element optimizer state (Adam's ``exp_avg``, SGD's ``momentum_buffer``)
as ``optim/<name>/<key>`` pieces, the names a single-process torch optimizer uses; scalar state (Adam's
``step``) is stored once per parameter, as torch does. A checkpoint written by any ZeRO stage and world
size therefore loads into any other, into DataParallel or into one process, and back.
"""

from __future__ import annotations

import torch


def _owned_ranges(eng) -> list[tuple[str, tuple[int, ...], int, int, int]]:
    """(name, shape, flat start in the parameter, length, offset in the shard space) for every parameter
    range this rank owns."""
    out = []
    space = eng.space
    for g, lay in enumerate(space.layouts):
        a, b = lay.shard_range(space.rank)
        for name, shape, o, n in zip(lay.names, lay.shapes, lay.offsets, lay.numels):
            lo, hi = max(a, o), min(b, o + n)
            if lo < hi:
                out.append((name, tuple(shape), lo - o, hi - lo, space.offsets[g] + lo - a))
    return out


def _piece(name: str, shape, start: int, length: int):
    from pyparallel.checkpoint import Piece

    return Piece(name, shape, (0,) * len(shape), shape, start, length, owner=True)


def model_pieces(zmodel) -> list:
    """(Piece, tensor) pairs of a ZeRO model: master ranges, frozen parameters and buffers (replicated)."""
    from pyparallel.checkpoint import Piece

    eng = zmodel.engine
    master = eng.updater.master
    out = [(_piece("model/" + name, shape, start, n), master[at:at + n])
           for name, shape, start, n, at in _owned_ranges(eng)]
    for name, p in eng.frozen:
        out.append((Piece.whole("model/" + name, p.shape), p.detach()))
    for name, b in zmodel.module.named_buffers():
        out.append((Piece.whole("model/" + name, b.shape), b))
    return out


@torch.no_grad()
def load_model_pieces(zmodel, reader) -> None:
    """Fill the master ranges, frozen parameters and buffers from a checkpoint, then refresh the compute
    weights from the master (a collective in stages 1-2)."""
    for piece, tensor in model_pieces(zmodel):
        tensor.copy_(reader.piece(piece).view(tensor.shape))
    zmodel.engine.refresh_weights()


def _state(zopt) -> tuple[torch.Tensor, dict]:
    param = zopt.inner.param_groups[0]["params"][0]
    return param, zopt.inner.state[param]


def optimizer_pieces(zopt) -> list:
    """(Piece, tensor) pairs of the inner optimizer's state (empty before the first step)."""
    from pyparallel.checkpoint import Piece

    eng = zopt.engine
    _, state = _state(zopt)
    ranges = _owned_ranges(eng)
    names = [n for lay in eng.space.layouts for n in lay.names]
    out = []
    for key, value in state.items():
        if not torch.is_tensor(value):
            continue
        if value.dim() == 1 and value.numel() == eng.space.numel:  # per element: sharded like the master
            out += [(_piece(f"optim/{name}/{key}", shape, start, n), value[at:at + n])
                    for name, shape, start, n, at in ranges]
        else:  # a scalar (Adam's step): the same on every rank, stored per parameter as torch does
            out += [(Piece.whole(f"optim/{name}/{key}", value.shape), value) for name in names]
    return out


@torch.no_grad()
def load_optimizer_pieces(zopt, reader, manifest: dict) -> None:
    """Rebuild the inner optimizer's state over this rank's shard from a checkpoint written in any layout
    (state tensors are created when the optimizer has not stepped yet), and its hyper-parameters."""
    eng = zopt.engine
    param, state = _state(zopt)
    first = eng.space.layouts[0].names[0]
    prefix = f"optim/{first}/"
    for key in sorted(n[len(prefix):] for n in reader.names() if n.startswith(prefix)):
        saved = reader.full(prefix + key)
        if saved.dim() == 0:
            state[key] = saved.clone().to(param.device) if key != "step" else saved.clone()
            continue
        value = state.get(key)
        if value is None:
            value = state[key] = torch.zeros(eng.space.numel, dtype=torch.float32, device=param.device)
        for name, shape, start, n, at in _owned_ranges(eng):
            value[at:at + n].copy_(reader.piece(_piece(f"optim/{name}/{key}", shape, start, n)))
    for group, saved in zip(zopt.inner.param_groups, manifest.get("optimizer_groups") or []):
        group.update({k: v for k, v in saved.items() if k != "params"})
