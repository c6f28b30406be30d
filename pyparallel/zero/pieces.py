"""The one checkpoint description of a sharded data-parallel rank (``pyparallel.checkpoint``'s pieces), for
every ZeRO stage, tensor-parallel shard and pipeline stage: what ``zero.setup``'s and ``parallelize``'s
models and optimizers save and load.

Names are the unparallelised model's: ``model/<parameter>`` (from the master, so fp32 even when training
in bf16), ``optim/<parameter>/<state key>`` for the optimizer state -- the names ``checkpoint`` uses for a
plain model and a torch optimizer, so any layout loads into any other. A rank's slice of a flat group is,
for each parameter it overlaps, a flat range of that parameter's TP box(es) (``layout.flat_pieces``).
Each element is written by exactly one rank: the one that counts it in the gradient norm. Per-parameter
scalars of the optimizer state (Adam's ``step``) are written by the holder of the parameter's first
element. The loss scaler (fp16) is ``amp/loss_scaler``; per-group hyper-parameters travel in the manifest
(``optimizer_groups``, in param_group order) and the optimizer's state is loaded in the master's dtype.
"""

from __future__ import annotations

import torch

from pyparallel.checkpoint.format import CheckpointError, Piece
from pyparallel.combined.layout import ParamInfo, flat_pieces


def _overlaps(eng, lo_hi=None):
    """(flat group g, ParamInfo, [lo, hi) in the local tensor's flat order, offset of lo in g's shard slice,
    whether this rank writes it) for every parameter part in this rank's slices (or in ``lo_hi`` =
    (g, start, stop) of one slice). A weight tied across stages is written part by part, each part by the
    stage that updates it (``ShardEngine.owned_range``): the other parts of its master are stale there."""
    groups = range(len(eng.layouts)) if lo_hi is None else [lo_hi[0]]
    for g in groups:
        lay = eng.layouts[g]
        base, b = lay.shard_range(eng.rank)
        a = base
        if lo_hi is not None:
            a, b = base + lo_hi[1], base + lo_hi[2]
        own_a, own_b = eng.owned_range(g)
        cuts = sorted({a, b, *(c for c in (own_a, own_b) if a < c < b)})
        for p, o, n in zip(lay.params, lay.offsets, lay.numels):
            info = eng.infos[id(p)]
            for ca, cb in zip(cuts, cuts[1:]):
                lo, hi = max(ca, o), min(cb, o + n)
                if lo < hi:
                    owns = own_a <= lo and hi <= own_b
                    yield g, info, lo - o, hi - o, lo - base, eng.dp_owner and info.counted and owns


def _shard_pieces(eng, prefix_of, source_of, lo_hi=None, shift: int = 0):
    """(Piece, view) of each parameter part; ``source_of(g)`` is the tensor holding group g's slice
    (``shift``: where that tensor starts in the slice)."""
    out = []
    for g, info, lo, hi, at, owner in _overlaps(eng, lo_hi):
        src = source_of(g)
        for seg, start, length, off in flat_pieces(info, lo, hi):
            piece = Piece(prefix_of(info), info.global_shape, seg.box_offsets, seg.box_shape, start, length,
                          owner=owner, perm=seg.perm)
            s = at - shift + off
            out.append((piece, src[s:s + length]))
    return out


def _whole_pieces(info: ParamInfo, tensor: torch.Tensor, name: str, owner: bool):
    flat = tensor.reshape(-1)
    return [(Piece(name, info.global_shape, s.box_offsets, s.box_shape, 0, s.numel, owner=owner, perm=s.perm),
             flat[s.local_start:s.local_start + s.numel]) for s in info.segments]


_SCALER_KEYS = ("scale", "skipped_steps", "good_steps", "since_growth")


def model_pieces(eng, buffers, first: bool) -> list[tuple[Piece, torch.Tensor]]:
    """Weights (from the master), frozen parameters, ``buffers`` ([(name, tensor, owner)]) and the loss
    scaler of this rank; ``first``: this rank is the first data-parallel replica (writes replicated data)."""
    out = _shard_pieces(eng, lambda info: "model/" + info.name, eng.master_slice)
    for info, p in eng.frozen:
        out += _whole_pieces(info, p.detach(), "model/" + info.name, first and info.counted)
    for name, buf, owner in buffers:
        out.append((Piece("model/" + name, tuple(buf.shape), (0,) * buf.dim(), tuple(buf.shape), owner=owner), buf))
    if eng.scaler is not None:
        sd = eng.scaler.state_dict()
        state = torch.tensor([float(sd[k]) for k in _SCALER_KEYS], dtype=torch.float64)
        out.append((Piece.whole("amp/loss_scaler", (4,)), state))  # the same on every rank
    return out


@torch.no_grad()
def load_model(eng, reader, buffers) -> None:
    """Fill the masters, frozen parameters, buffers and loss scaler from a checkpoint of any layout, then
    refresh the compute weights (a collective in stages 1-2)."""
    for piece, view in _shard_pieces(eng, lambda info: "model/" + info.name, eng.master_slice):
        view.copy_(reader.piece(piece))
    eng.refresh_weights()
    for info, p in eng.frozen:
        for piece, view in _whole_pieces(info, p.detach(), "model/" + info.name, True):
            view.copy_(reader.piece(piece))
    for name, buf, _ in buffers:
        if reader.has("model/" + name):
            buf.copy_(reader.full("model/" + name).view(buf.shape))
    if eng.scaler is not None and reader.has("amp/loss_scaler"):
        values = reader.full("amp/loss_scaler").tolist()
        eng.scaler.load_state_dict({k: (v if k == "scale" else int(v)) for k, v in zip(_SCALER_KEYS, values)})


def _run_params(eng):
    """(run, optimizer tensor) pairs of this rank."""
    return list(zip(eng.runs, eng.updater.params))


def _holds_origin(info: ParamInfo) -> bool:
    """Whether this rank's TP shard of ``info`` starts at the global tensor's first element."""
    seg = info.segments[0]
    return seg.local_start == 0 and all(o == 0 for o in seg.box_offsets)


def optimizer_pieces(eng) -> list[tuple[Piece, torch.Tensor]]:
    """``optim/<name>/<key>``: element-wise state as shards, per-parameter scalars once per parameter."""
    opt = eng.optimizer
    out = []
    for run, prm in _run_params(eng):
        state = opt.state.get(prm, {})
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            if value.dim() == 1 and value.numel() == run.hi - run.lo:
                out += _shard_pieces(eng, lambda info, k=key: f"optim/{info.name}/{k}", lambda g, v=value: v,
                                     (run.g, run.lo, run.hi), shift=run.lo)
            elif value.numel() == 1:
                for _g, info, lo, _hi, _at, owner in _overlaps(eng, (run.g, run.lo, run.hi)):
                    if owner and lo == 0 and _holds_origin(info):
                        out.append((Piece(f"optim/{info.name}/{key}", tuple(value.shape), (0,) * value.dim(),
                                          tuple(value.shape), owner=True), value))
            else:
                raise CheckpointError(f"optimizer state {key!r} has {value.numel()} elements; only element-wise "
                                      f"state (one value per parameter element) and scalars can be resharded")
    return out


@torch.no_grad()
def load_optimizer(eng, reader, manifest: dict) -> None:
    """Rebuild this rank's optimizer state from a checkpoint of any layout: element-wise state (saved with
    the parameter's global shape) is cut into this rank's runs in the master's dtype, scalars are copied;
    then each param_group's hyper-parameters."""
    opt = eng.optimizer
    infos = {eng.infos[id(p)].name: eng.infos[id(p)] for lay in eng.layouts for p in lay.params}
    keys = sorted({k.rsplit("/", 1)[1] for k in reader.names()
                   if k.startswith("optim/") and k[len("optim/"):].rsplit("/", 1)[0] in infos})
    for run, prm in _run_params(eng):
        state = {}
        names = [info.name for _g, info, *_ in _overlaps(eng, (run.g, run.lo, run.hi))]
        for key in keys:
            name = next((n for n in names if reader.has(f"optim/{n}/{key}")), None) or \
                next(n for n in sorted(infos) if reader.has(f"optim/{n}/{key}"))
            sample = reader.full(f"optim/{name}/{key}")
            if tuple(sample.shape) == infos[name].global_shape:
                value = torch.zeros(run.hi - run.lo, dtype=prm.dtype, device=prm.device)
                for piece, view in _shard_pieces(eng, lambda i, k=key: f"optim/{i.name}/{k}", lambda g, v=value: v,
                                                 (run.g, run.lo, run.hi), shift=run.lo):
                    view.copy_(reader.piece(piece))
            elif sample.numel() == 1:
                value = sample.clone()
            else:
                raise CheckpointError(f"optim/{name}/{key} has shape {tuple(sample.shape)}: neither the "
                                      f"parameter's {infos[name].global_shape} nor a scalar")
            state[key] = value
        if state:
            opt.state[prm] = state
    saved_groups = manifest.get("optimizer_groups") or []
    for group, saved in zip(opt.param_groups, saved_groups):
        for k, v in (saved or {}).items():
            if k in group and k != "params":
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
