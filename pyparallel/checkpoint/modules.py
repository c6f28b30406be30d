"""Checkpoint pieces of ordinary modules and torch optimizers: a plain model, one wrapped by
``DataParallel``, one whose layers ``tensor_parallel.parallelize`` replaced, or a ``PipelineParallel``
stage -- with a ``torch.optim`` optimizer over its parameters.

Every parameter is described by a :class:`~pyparallel.combined.layout.ParamInfo` (global name and shape,
the TP boxes its local tensor holds), so the same code writes a whole replicated tensor and a TP shard.
Who writes: with no mesh in sight (a plain or DDP model), global rank 0 (``owner=None``); with one (TP,
PP), the rank that counts the tensor (TP rank 0 for replicated ones, the first stage for a tied weight)
on DP rank 0. Pipeline stages name parameters by the global block index (``blocks.<k>.<name>``), or,
for the built-in GPT, by the unparallelised model's names (``embed.*``, ``blocks.<k-1>.*``, ``head.*``).
"""

from __future__ import annotations

import re

import torch

from pyparallel.checkpoint import CheckpointError, Piece
from pyparallel.combined.layout import ParamInfo, describe, tp_owners


def _inner(model):
    return getattr(model, "module", model)  # DataParallel and friends wrap a whole replica


def _pipeline_name(pipe, name: str, tensor) -> str:
    """``chunk3.blocks.1.attn.q_proj.weight`` -> the unparallelised model's name of that tensor (recorded
    when the model was split into blocks), else that of the parameter of global block k."""
    m = re.match(r"chunk(\d+)\.blocks\.(\d+)\.(.*)", name)
    c, i, rest = int(m.group(1)), int(m.group(2)), m.group(3)
    own = getattr(pipe.chunks[c].blocks[i], "_pyparallel_names", {}).get(id(tensor))
    if own is not None:
        return own
    k = pipe.chunks[c].first_block + i
    from pyparallel.models.gpt import Block, Embedding, Head

    if not all(isinstance(b, (Embedding, Block, Head)) for b in pipe._meta_blocks):
        return f"blocks.{k}.{rest}"
    if k == 0:
        return f"embed.{rest}"
    return f"head.{rest}" if k == pipe.bounds[-1] - 1 else f"blocks.{k - 1}.{rest}"


def describe_model(model):
    """``(infos, owner_fn, buffers)``: [(ParamInfo, parameter)] for this rank's parameters, a function
    ``ParamInfo -> owner flag``, and [(global name, buffer)]."""
    from pyparallel.pipeline_parallel.engine import PipelineParallel

    if isinstance(model, PipelineParallel):
        tied = {id(p): tuple(sorted(model.mesh.coords_of(r).pp for r in g.ranks)) for p, g in model._tied}
        named = [(_pipeline_name(model, n, p), p) for n, p in model.named_parameters()]
        buffers = [(_pipeline_name(model, n, b), b) for c, ch in sorted(model.chunks.items())
                   for n, b in ch.named_buffers(prefix=f"chunk{c}")]
        mesh, owners, t, r = model.mesh, {}, 1, 0
    else:
        inner = _inner(model)
        tp = getattr(inner, "_pyparallel_tp", None)
        mesh = tp["mesh"] if tp else None
        owners = tp_owners(inner) if tp else {}
        t, r = (mesh.tp, mesh.tp_rank) if mesh is not None else (1, 0)
        named = list(inner.named_parameters())  # a tied weight once, under its first name
        buffers = list(inner.named_buffers())
        tied = {}
    infos = []
    for name, p in named:
        info = describe(name, p, owners.get(id(p)), t, r)
        if id(p) in tied:
            info.tie_stages = tied[id(p)]
            info.counted = info.counted and mesh.pp_rank == info.tie_stages[0]
        infos.append((info, p))

    def owner(info: ParamInfo):
        return None if mesh is None else (info.counted and mesh.dp_rank == 0)

    return infos, owner, buffers, mesh


def _pieces_of(info: ParamInfo, tensor: torch.Tensor, name: str, owner):
    flat = tensor.detach().reshape(-1)
    return [(Piece(name, info.global_shape, s.box_offsets, s.box_shape, 0, s.numel, owner=owner, perm=s.perm),
             flat[s.local_start:s.local_start + s.numel]) for s in info.segments]


def module_pieces(model):
    infos, owner, buffers, mesh = describe_model(model)
    out = []
    for info, p in infos:
        out += _pieces_of(info, p, "model/" + info.name, owner(info))
    for name, b in buffers:
        own = None if mesh is None else (mesh.dp_rank == 0 and mesh.tp_rank == 0)
        out.append((Piece("model/" + name, tuple(b.shape), (0,) * b.dim(), tuple(b.shape), owner=own), b))
    return out


@torch.no_grad()
def load_module(model, reader) -> None:
    infos, _, buffers, _ = describe_model(model)
    for info, p in infos:
        for piece, view in _pieces_of(info, p, "model/" + info.name, None):
            view.copy_(reader.piece(piece))
    for name, b in buffers:
        if reader.has("model/" + name):
            b.copy_(reader.full("model/" + name).view(b.shape))


def optimizer_pieces(model, optimizer):
    """``optim/<name>/<key>`` of a torch optimizer: state shaped like the parameter as its TP boxes,
    scalars (Adam's ``step``) once, by the holder of the parameter's first element."""
    infos, owner, _, mesh = describe_model(model)
    by_id = {id(p): info for info, p in infos}
    out = []
    for p, state in optimizer.state.items():
        info = by_id.get(id(p))
        if info is None:
            raise CheckpointError("the optimizer holds a parameter that the model does not: pass the model whose "
                                  "parameters the optimizer updates")
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            name = f"optim/{info.name}/{key}"
            if value.shape == p.shape:
                out += _pieces_of(info, value, name, owner(info))
            elif value.numel() == 1:
                seg = info.segments[0]
                origin = seg.local_start == 0 and all(o == 0 for o in seg.box_offsets)
                own = None if mesh is None else (origin and owner(info))
                out.append((Piece(name, tuple(value.shape), (0,) * value.dim(), tuple(value.shape), owner=own),
                            value))
            else:
                raise CheckpointError(f"optimizer state {key!r} of {info.name} has shape {tuple(value.shape)}: "
                                      f"neither the parameter's nor a scalar")
    return out


@torch.no_grad()
def load_torch_optimizer(model, optimizer, reader, manifest: dict) -> None:
    """Rebuild a torch optimizer's state for this rank's (possibly TP-sharded) parameters."""
    infos, _, _, _ = describe_model(model)
    by_id = {id(p): info for info, p in infos}
    state, groups, index = {}, [], 0
    for g, saved in zip(optimizer.param_groups, manifest.get("optimizer_groups") or [{}] * len(optimizer.param_groups)):
        ids = []
        for p in g["params"]:
            info = by_id[id(p)]
            prefix = f"optim/{info.name}/"
            entry = {}
            for key in [k[len(prefix):] for k in reader.names() if k.startswith(prefix)]:
                full = reader.full(prefix + key)
                if tuple(full.shape) == info.global_shape:
                    # zeros: rows no piece covers (vocabulary padding) hold zero state, as their weights do
                    local = torch.zeros(p.shape, dtype=full.dtype).reshape(-1)
                    for piece, view in _pieces_of(info, local, prefix + key, None):
                        view.copy_(reader.piece(piece))
                    entry[key] = local.view(p.shape)
                else:
                    entry[key] = full.clone()
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**g, **saved, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
