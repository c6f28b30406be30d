"""Model-state bytes per rank, measured from the objects a rank actually holds.

ZeRO (Rajbhandari et al. 2020, section 3.1 and figure 1) splits model states into parameters, gradients
and optimizer states; with mixed-precision Adam that is 2 + 2 + 12 bytes per parameter (the 12: fp32
master, momentum, variance), and per rank with N data-parallel ranks

    DDP 16Ψ,   ZeRO-1 4Ψ + 12Ψ/N,   ZeRO-2 2Ψ + 14Ψ/N,   ZeRO-3 16Ψ/N.

:func:`model_state_bytes` reports the same parts for what this process holds, so the formulas can be
checked (``pyparallel.planner.memory.model_state_bytes`` predicts them). Sizes are structural where the
library knows them (flat buffers, shards) and measured where it does not: optimizer state is counted
from the optimizer's ``state`` tensors, which torch optimizers allocate at their first ``step()``, so call
this after one step. ZeRO's transient buffers (buckets in flight, gathered stage-3 units, step-time
copies) are listed separately under ``buffers`` with their peak sizes and are not model states.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _tensor_bytes(obj) -> int:
    from pyparallel.zero.updater import tensor_bytes

    return tensor_bytes(obj)


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())  # parameters() already yields a tied weight once


def _report(params: int, grads: int, optimizer: int, master: int, buffers: dict, cpu: dict | None = None,
            padding_elements: int = 0) -> dict:
    states = params + grads + optimizer + master
    buffers_total = sum(buffers.values())
    cpu = dict(cpu or {})
    return {"params": params, "grads": grads, "optimizer": optimizer, "master": master,
            "model_states": states, "buffers": dict(buffers), "buffers_total": buffers_total,
            "cpu": cpu, "cpu_total": cpu.get("total", sum(cpu.values())),
            "padding_elements": padding_elements, "total": states + buffers_total}


def _plain(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    params = _unique_params(module)
    pbytes = sum(p.numel() * p.element_size() for p in params)
    # Backward allocates one gradient per trainable parameter, in its dtype, whether or not one exists now.
    gbytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    obytes = _tensor_bytes(list(optimizer.state.values())) if optimizer is not None else 0
    return _report(pbytes, gbytes, obytes, 0, {})


def _ddp(model, optimizer) -> dict:
    params = _unique_params(model.module)
    pbytes = sum(p.numel() * p.element_size() for p in params)
    gbytes = sum(b.nbytes for b in model.buckets)  # every gradient lives in its bucket
    buffers = {}
    comm_bytes = sum(b.comm_buffer.numel() * b.comm_buffer.element_size()
                     for b in model.buckets if b.comm_buffer is not None)
    if comm_bytes:
        buffers["reduce_dtype_buckets"] = comm_bytes
    obytes = _tensor_bytes(list(optimizer.state.values())) if optimizer is not None else 0
    return _report(pbytes, gbytes, obytes, 0, buffers)


def _sharded(engine) -> dict:
    from pyparallel.zero.updater import DeviceUpdater

    states, buffers, pad = engine.memory_parts()
    updater = engine.updater
    if isinstance(updater, DeviceUpdater):
        opt = updater.state_bytes()["optimizer"]
        # The master: a tensor of its own only when the weights are kept in another (lower) precision.
        return _report(states["params"], states["grads"], opt, engine.master_bytes(), buffers, padding_elements=pad)
    host = {k: int(v) for k, v in updater.state_bytes().items() if isinstance(v, (int, float))}
    return _report(states["params"], states["grads"], 0, 0, buffers, cpu=host, padding_elements=pad)


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """This rank's model-state bytes: ``params``, ``grads``, ``optimizer`` (state tensors, master excluded),
    ``master`` (fp32 master weights), their sum ``model_states``; ``buffers`` (name -> peak bytes of the
    transient buffers ZeRO keeps for reduction/gathering), ``buffers_total``; ``cpu`` (host-side bytes when
    the optimizer is offloaded, not in the totals); ``padding_elements`` (elements ZeRO's flat groups add
    over all ranks); ``total`` = model states + buffers.

    ``model`` may be a ``pyparallel.zero`` model, a ``pyparallel.parallelize`` model (this rank's stage and
    TP shard), a ``pyparallel.DataParallel`` or a plain module (then
    ``optimizer`` is any torch optimizer). Call after the first optimizer step.
    """
    from pyparallel.data_parallel.ddp import DataParallel
    from pyparallel.zero.engine import ShardEngine

    engine = getattr(model, "engine", None)
    if isinstance(engine, ShardEngine):  # pyparallel.zero.setup's and pyparallel.parallelize's models
        return _sharded(engine)
    if isinstance(model, DataParallel):
        return _ddp(model, optimizer)
    if isinstance(model, nn.Module):
        return _plain(model, optimizer)
    raise ValueError(f"model_state_bytes needs an nn.Module (plain, DataParallel, ZeRO) or a parallelize() model, "
                     f"got {model!r}")
