"""Who holds what: asking a model and its optimizer for their pieces, and handing pieces back on load.

One protocol: a wrapper that knows its shards describes them itself (``checkpoint_pieces()`` /
``load_checkpoint_pieces(reader, manifest)``: the models and optimizers of ``pyparallel.zero.setup`` and
``pyparallel.parallelize``, through zero/pieces.py). Every other module (plain, DataParallel,
tensor-parallelized, a PipelineParallel stage) and torch optimizer is described by checkpoint/modules.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import torch

from pyparallel import comm
from pyparallel.checkpoint.format import Piece, _assemble


def _module_pieces(model) -> list[tuple[Piece, torch.Tensor]]:
    provider = getattr(model, "checkpoint_pieces", None)
    if provider is not None:
        return provider()
    from pyparallel.checkpoint import modules

    return modules.module_pieces(model)


def _optimizer_pieces(model, optimizer) -> list[tuple[Piece, torch.Tensor]]:
    provider = getattr(optimizer, "checkpoint_pieces", None)
    if provider is not None:
        return provider()
    from pyparallel.checkpoint import modules

    return modules.optimizer_pieces(model, optimizer)


def _load_model(model, reader) -> None:
    loader = getattr(model, "load_checkpoint_pieces", None)
    if loader is not None:
        return loader(reader, None)
    from pyparallel.checkpoint import modules

    return modules.load_module(model, reader)


def _load_optimizer(model, optimizer, reader, manifest) -> None:
    loader = getattr(optimizer, "load_checkpoint_pieces", None)
    if loader is not None:
        return loader(reader, manifest)
    from pyparallel.checkpoint import modules

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
