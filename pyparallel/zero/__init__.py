"""ZeRO: Zero Redundancy Optimizer data parallelism (Rajbhandari et al. 2020), stages 1, 2 and 3.

One entry point for all stages::

    model, optimizer = pyparallel.zero.setup(module, mesh, stage=2, optimizer=torch.optim.AdamW, lr=3e-4,
                                             weight_decay=0.1, param_dtype=torch.bfloat16)
    for idx, targets in data:
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

Per-rank model-state bytes with mixed-precision Adam and N data-parallel ranks (ZeRO figure 1): stage 1
4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N (``pyparallel.memory.model_state_bytes`` reports the
actual figures). Communication per step: 2Ψ elements for stages 1 and 2 (reduce-scatter + all-gather),
3Ψ for stage 3 (all-gather in forward and in backward + reduce-scatter). See docs/zero.md.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from pyparallel.amp import DynamicLossScaler, MixedPrecision
from pyparallel.data_parallel.ddp import DataParallel, broadcast_tensors, check_same_parameters
from pyparallel.mesh import ParallelMesh
from pyparallel.zero.module import ZeroModule
from pyparallel.zero.optimizer import Stage12Engine
from pyparallel.zero.stage3 import Stage3Engine
from pyparallel.zero.step import DeviceUpdater, ZeroOptimizer
from pyparallel.zero.wrap import select_units

__all__ = ["ZeroModule", "ZeroOptimizer", "setup"]

# Optimizers whose update of each element depends only on that element's gradient and state: exact on a
# flat shard. Factored or whole-matrix methods (Adafactor, Muon, LBFGS, Shampoo) are not.
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam",
                "RAdam", "ASGD"}


def _check_optimizer(optimizer, kwargs: dict) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be an optimizer class such as torch.optim.AdamW, not an instance "
                         f"({type(optimizer).__name__} object): ZeRO builds it over each rank's shard")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer subclass, got {optimizer!r}")
    known = optimizer.__module__.startswith("torch.optim") and optimizer.__name__ in _ELEMENTWISE
    if not (known or getattr(optimizer, "elementwise", False) or optimizer.__module__.startswith("pyparallel.")):
        raise ValueError(
            f"optimizer {optimizer.__name__} is not known to be element-wise; ZeRO updates flat 1/N shards, "
            f"which is exact only for element-wise rules ({', '.join(sorted(_ELEMENTWISE))}). Set the class "
            f"attribute `elementwise = True` on your optimizer if its update of each element depends only "
            f"on that element.")
    try:
        inspect.signature(optimizer).bind(None, **kwargs)
    except TypeError as exc:
        raise ValueError(f"optimizer arguments {sorted(kwargs)} do not fit {optimizer.__name__}: {exc}") from None


def _check_args(module, mesh, stage, bucket_cap_mb, clip_grad_norm, wrap_policy) -> None:
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r} (stage 0 is plain pyparallel.DataParallel)")
    if not isinstance(module, nn.Module) or isinstance(module, (ZeroModule, DataParallel)):
        raise ValueError(f"module must be a plain nn.Module (not already wrapped), got {type(module).__name__}")
    if not isinstance(mesh, ParallelMesh):
        raise ValueError(f"mesh must be a pyparallel.ParallelMesh (from pyparallel.init()), got {mesh!r}")
    if not bucket_cap_mb or bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be a positive number or None, got {clip_grad_norm!r}")
    if wrap_policy is not None and stage != 3:
        raise ValueError(f"wrap_policy only applies to stage 3 (got stage {stage}); stages 1 and 2 keep whole "
                         f"parameters on every rank")
    if stage == 3:
        select_units(module, wrap_policy)  # a bad policy fails here, before any collective
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("module has no trainable parameters (requires_grad=True): nothing for ZeRO to shard")
    dtypes = {p.dtype for p in trainable}
    if len(dtypes) != 1 or not trainable[0].is_floating_point():
        raise ValueError(f"trainable parameters must share one floating dtype, found {sorted(map(str, dtypes))}")
    devices = {p.device for p in params}
    if any(d.type != mesh.device.type for d in devices):
        raise ValueError(f"parameters live on {sorted(map(str, devices))} but the mesh computes on {mesh.device}; "
                         f"move the module with module.to(mesh.device) first")


def _make_updater(engine, offload: bool, factory, device, kwargs: dict):
    if not offload:
        # torch's own implementation choices (foreach/fused/capturable) are respected when given.
        fuse = not any(k in kwargs for k in ("foreach", "fused", "capturable", "differentiable"))
        return DeviceUpdater(engine.master_init, factory, device, fuse=fuse)
    from pyparallel.zero.offload import OptimizerOffload  # lazy: owned and tested separately

    return OptimizerOffload(engine.master_init.clone(), factory, device)


def setup(module: nn.Module, mesh: ParallelMesh, stage: int = 1, optimizer=torch.optim.AdamW, lr: float | None = None,
          *, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
          bucket_cap_mb: float = 25.0, clip_grad_norm: float | None = None, offload_optimizer: bool = False,
          wrap_policy=None, loss_scaler: DynamicLossScaler | None = None, **optimizer_kwargs):
    """Wrap ``module`` for ZeRO ``stage`` over ``mesh``'s data-parallel group; returns ``(model, optimizer)``.

    Args:
        module: the model (same on every rank: checked; rank 0's weights are broadcast).
        mesh: the :class:`pyparallel.ParallelMesh`; ``mesh.dp_group`` carries every collective.
        stage: 1 (optimizer state + master sharded), 2 (+ gradients), 3 (+ parameters).
        optimizer: an element-wise optimizer class (AdamW, Adam, SGD, ..., pyparallel.optim.CPUAdam),
            built by ZeRO over this rank's flat fp32 master shard with ``lr`` and ``optimizer_kwargs`` (one
            parameter group: every parameter gets the same hyper-parameters).
        param_dtype: compute dtype (torch.bfloat16 / torch.float16) with fp32 master weights in the
            shards; None keeps the module's dtype. fp16 turns on dynamic loss scaling (``loss_scaler``).
        reduce_dtype: dtype of gradient reductions and gradient shards (fp32 by default).
        bucket_cap_mb: bucket size for stages 1-2 (MiB of compute-dtype weights).
        clip_grad_norm: clip by the global gradient norm across all shards (None: no clipping).
        offload_optimizer: keep master weights and optimizer state on the host
            (``pyparallel.zero.offload.OptimizerOffload``).
        wrap_policy: stage 3 only: which modules are gathered as units (see ``pyparallel.zero.wrap``).
    """
    _check_args(module, mesh, stage, bucket_cap_mb, clip_grad_norm, wrap_policy)
    kwargs = dict(optimizer_kwargs)
    if lr is not None:
        kwargs["lr"] = lr
    _check_optimizer(optimizer, kwargs)
    policy = MixedPrecision(param_dtype, reduce_dtype)
    if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
        raise ValueError(f"loss_scaler must be a pyparallel.amp.DynamicLossScaler, got {loss_scaler!r}")
    if loss_scaler is not None and not policy.needs_loss_scaling:
        raise ValueError("loss_scaler only applies with param_dtype=torch.float16")
    if offload_optimizer:
        try:
            import pyparallel.zero.offload  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"offload_optimizer=True needs pyparallel.zero.offload, which failed to import "
                             f"({exc}); pass offload_optimizer=False") from None
    group = mesh.dp_group
    module_dtype = next(p.dtype for p in module.parameters() if p.requires_grad)
    check_same_parameters(list(module.named_parameters()), group, "ZeRO")  # the first collective
    broadcast_tensors([p for p in module.parameters()] + list(module.buffers()), group)
    if stage == 3:
        engine = Stage3Engine(module, group, policy, mesh.device, module_dtype, wrap_policy)
    else:
        engine = Stage12Engine(module, group, stage, policy, max(1, int(bucket_cap_mb * 2**20)), mesh.device,
                               module_dtype)
    built = []

    def factory(params):
        built.append(optimizer(params, **kwargs))
        return built[-1]

    updater = _make_updater(engine, offload_optimizer, factory, mesh.device, kwargs)
    engine.attach_updater(updater)
    if not built:
        raise RuntimeError("the optimizer updater did not build its optimizer at construction")
    engine.master_init = None  # the updater owns the master from here on
    scaler = (loss_scaler or DynamicLossScaler()) if policy.needs_loss_scaling else None
    model = ZeroModule(module, engine, policy, scaler, mesh)
    opt = ZeroOptimizer(engine, engine.updater, built[-1], clip_grad_norm, scaler)
    return model, opt
