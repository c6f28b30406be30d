"""Checkpoint pieces of a model and optimizer from ``pyparallel.zero.setup`` (stages 1, 2 and 3).

A rank's fp32 master slice covers, in every flat group (a stage-1/2 bucket, a stage-3 unit), the flat
range ``[r*S, (r+1)*S)``; for each parameter that range overlaps it is a flat range of the parameter
(of its TP box when the module was tensor-parallelized first). Those ranges are the pieces
(``combined.pieces`` does the arithmetic, shared with ``pyparallel.parallelize``); every rank writes its
own, so nothing is gathered. The weights are written from the fp32 master, the optimizer state
(``optim/<name>/<key>``) from the shard the inner optimizer holds. Loading cuts this rank's ranges out
of any saved layout and refreshes the compute weights (stages 1-2: all-gather; stage 3: the shard).
"""

from __future__ import annotations

import torch

from pyparallel.checkpoint import Piece
from pyparallel.combined import pieces as shard_pieces
from pyparallel.combined.layout import describe, tp_owners


class _View:
    """What ``combined.pieces`` reads from an engine, for a ZeRO stage engine."""

    def __init__(self, engine, module):
        self.engine = engine
        self.layouts, self.space, self.updater = engine.layouts, engine.space, engine.updater
        self.rank, self.stage, self.mesh = engine.group.rank, engine.stage, None
        tp = getattr(module, "_pyparallel_tp", None)
        owners = tp_owners(module) if tp else {}
        t, r = (tp["mesh"].tp, tp["mesh"].tp_rank) if tp else (1, 0)
        self.infos = {}
        for lay in self.layouts:
            for name, p, shape in zip(lay.names, lay.params, lay.shapes):
                stand_in = torch.empty(shape, device="meta")  # stage 3 has freed the parameter's storage
                self.infos[id(p)] = describe(name, stand_in, owners.get(id(p)), t, r)


def _view(zmodel) -> _View:
    view = getattr(zmodel, "_checkpoint_view", None)
    if view is None:
        view = zmodel._checkpoint_view = _View(zmodel.engine, zmodel.module)
    return view


def model_pieces(zmodel) -> list[tuple[Piece, torch.Tensor]]:
    view = _view(zmodel)
    eng = zmodel.engine
    out = shard_pieces._shard_pieces(view, lambda info: "model/" + info.name, eng.updater.master)
    first = eng.group.rank == 0
    for name, p in eng.frozen:
        out.append((Piece("model/" + name, tuple(p.shape), (0,) * p.dim(), tuple(p.shape), owner=first), p))
    for name, b in zmodel.module.named_buffers():
        out.append((Piece("model/" + name, tuple(b.shape), (0,) * b.dim(), tuple(b.shape), owner=first), b))
    scaler = zmodel._scaler
    if scaler is not None:
        out.append((Piece.whole("amp/loss_scaler", (4,)), torch.tensor(
            [scaler.scale, scaler.skipped_steps, scaler.good_steps, scaler._since_growth], dtype=torch.float64)))
    return out


@torch.no_grad()
def load_model(zmodel, reader) -> None:
    view = _view(zmodel)
    eng = zmodel.engine
    master = eng.updater.master
    for piece, target in shard_pieces._shard_pieces(view, lambda info: "model/" + info.name, master):
        target.copy_(reader.piece(piece))
    if eng.stage == 3:
        if eng.param_shard.data_ptr() != master.data_ptr():
            eng.param_shard.copy_(master)
    else:
        eng.publish(master.to(device=eng.device, dtype=eng.compute_dtype))
    for name, p in eng.frozen:
        p.copy_(reader.full("model/" + name).view(p.shape))
    for name, b in zmodel.module.named_buffers():
        if reader.has("model/" + name):
            b.copy_(reader.full("model/" + name).view(b.shape))
    if zmodel._scaler is not None and reader.has("amp/loss_scaler"):
        scale, skipped, good, since = reader.full("amp/loss_scaler").tolist()
        zmodel._scaler.load_state_dict({"scale": scale, "skipped_steps": int(skipped), "good_steps": int(good),
                                        "since_growth": int(since)})


def optimizer_pieces(zmodel, zopt) -> list[tuple[Piece, torch.Tensor]]:
    return shard_pieces.optimizer_pieces(_view(zmodel))


def load_optimizer(zmodel, zopt, reader, manifest: dict) -> None:
    shard_pieces.load_optimizer(_view(zmodel), reader, manifest)
    zopt.state = zopt.inner.state
