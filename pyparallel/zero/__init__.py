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
from pyparallel.combined.layout import describe
from pyparallel.data_parallel.ddp import DataParallel, broadcast_tensors, check_same_parameters
from pyparallel.mesh import ParallelMesh
from pyparallel.zero import groups as groups_mod
from pyparallel.zero.engine import NONFINITE, EngineConfig, NonFiniteGradientError, ShardEngine
from pyparallel.zero.flat_param import FlatLayout
from pyparallel.zero.module import ZeroModule
from pyparallel.zero.optimizer import ShardOptimizer
from pyparallel.zero.stage3 import UnitGatherer
from pyparallel.zero.wrap import assign_parameters, fold_small_units, select_units

ZeroOptimizer = ShardOptimizer  # the name zero.setup's optimizer had before the engines were one

__all__ = ["NonFiniteGradientError", "ShardOptimizer", "ZeroModule", "ZeroOptimizer", "setup"]

# Optimizers whose update of each element depends only on that element's gradient and state: exact on a
# flat shard. Factored or whole-matrix methods (Adafactor, Muon, LBFGS, Shampoo) are not.
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam",
                "RAdam", "ASGD"}


def _check_optimizer(optimizer, kwargs: dict) -> None:
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be an optimizer class such as torch.optim.AdamW, not an instance "
                         f"({type(optimizer).__name__} object): the engine builds it over each rank's shard. Pass "
                         f"the class, its arguments as keywords (lr=..., weight_decay=...), and its parameter "
                         f"groups as param_groups=[{{'params': [...], 'weight_decay': 0.0}}, ...]")
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
    devices = {p.device for p in params if not p.is_meta}  # meta: given storage by weights= or init
    if any(d.type != mesh.device.type for d in devices):
        raise ValueError(f"parameters live on {sorted(map(str, devices))} but the mesh computes on {mesh.device}; "
                         f"move the module with module.to(mesh.device) first")


def setup(module: nn.Module, mesh: ParallelMesh, stage: int = 1, optimizer=torch.optim.AdamW, lr: float | None = None,
          *, param_groups=None, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
          bucket_cap_mb: float = 25.0, clip_grad_norm: float | None = None, offload_optimizer: bool = False,
          wrap_policy=None, loss_scaler: DynamicLossScaler | None = None, nonfinite: str = "raise",
          weights=None, init=None, **optimizer_kwargs):
    """Wrap ``module`` for ZeRO ``stage`` over ``mesh``'s data-parallel group; returns ``(model, optimizer)``.

    Args:
        module: the model (same on every rank: checked; rank 0's weights are broadcast).
        mesh: the :class:`pyparallel.ParallelMesh`; ``mesh.dp_group`` carries every collective.
        stage: 1 (optimizer state + master sharded), 2 (+ gradients), 3 (+ parameters).
        optimizer: an element-wise optimizer class (AdamW, Adam, SGD, ..., pyparallel.optim.CPUAdam),
            built by the engine over this rank's shard with ``lr`` and ``optimizer_kwargs`` as defaults.
        param_groups: ``torch.optim``-style groups over ``module``'s own parameters
            (``[{"params": [...], "weight_decay": 0.0}, ...]``), each group's options overriding the
            defaults; parameters in no group get the defaults (one more group, last). The optimizer's
            ``param_groups`` are these, in this order (LR schedulers work).
        param_dtype: compute dtype (torch.bfloat16 / torch.float16) with fp32 master weights in the
            shards; None keeps the module's dtype (then no separate master copy is kept).
            fp16 turns on dynamic loss scaling (``loss_scaler``).
        reduce_dtype: dtype of gradient reductions and gradient shards (fp32 by default; an fp64 model
            reduces in fp64).
        bucket_cap_mb: bucket size for stages 1-2 (MiB of compute-dtype weights).
        clip_grad_norm: clip by the global gradient norm across all shards (None: no clipping).
        offload_optimizer: keep master weights and optimizer state on the host
            (``pyparallel.zero.offload.OptimizerOffload``).
        wrap_policy: stage 3 only: which modules are gathered as units (see ``pyparallel.zero.wrap``).
        weights: a safetensors file or Hugging Face checkpoint folder to load (names are the module's own);
            each rank reads only its shards' pieces. The module may be built on the meta device.
        init: for a module built on the meta device without ``weights``: ``init(name, module)`` initialises
            one module's parameters in place (default: the model's ``init_module``, else its
            ``reset_parameters()``; see ``pyparallel.materialize``).
        nonfinite: a step whose gradients hold inf/NaN (fp32/bf16; fp16 skips them through the loss scaler):
            "raise" (default: ``NonFiniteGradientError`` naming the step and parameter group, nothing
            updated), "skip" (every rank skips the step) or "ignore" (apply it, no check).
    """
    _check_args(module, mesh, stage, bucket_cap_mb, clip_grad_norm, wrap_policy)
    kwargs = dict(optimizer_kwargs)
    if lr is not None:
        kwargs["lr"] = lr
    _check_optimizer(optimizer, kwargs)
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE)}; got {nonfinite!r}")
    options, group_of = groups_mod.resolve(param_groups, module, optimizer, kwargs)
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
    reader = _materialize(module, mesh.device, weights, init, stage)
    group = mesh.dp_group
    module_dtype = next(p.dtype for p in module.parameters() if p.requires_grad)
    check_same_parameters(list(module.named_parameters()), group, "ZeRO")  # the first collective
    if reader is None:  # rank 0's values everywhere; with weights every rank reads its own pieces
        broadcast_tensors([p for p in module.parameters()] + list(module.buffers()), group)
    compute = policy.compute_dtype(module_dtype)
    master = torch.float64 if module_dtype == torch.float64 else torch.float32
    n_groups = len(options)
    named = list(module.named_parameters())
    specs = has_root = None
    if stage == 3:
        specs, has_root = _units(module, wrap_policy, group_of, n_groups)
        layouts = [FlatLayout(s.names, s.params, group.size) for s in specs]
    else:
        elem = torch.empty((), dtype=compute).element_size()
        layouts = groups_mod.grouped_buckets([(n, p) for n, p in named if p.requires_grad],
                                             max(1, int(bucket_cap_mb * 2**20)), group.size, elem, group_of, n_groups)
    # An fp64 model reduces in fp64, as under parallelize (an fp32 reduction would round its gradients).
    reduce = torch.float64 if module_dtype == torch.float64 else policy.reduce_dtype
    cfg = EngineConfig(stage=stage, compute_dtype=compute, reduce_dtype=reduce, master_dtype=master,
                       accum_dtype=compute, reduce_op="avg", offload=offload_optimizer,
                       fuse=not any(k in kwargs for k in ("foreach", "fused", "capturable", "differentiable")),
                       clip_grad_norm=clip_grad_norm, nonfinite=nonfinite)
    scaler = (loss_scaler or DynamicLossScaler()) if policy.needs_loss_scaling else None
    infos = [(describe(n, p, None, 1, 0), p) for n, p in named]
    engine = ShardEngine(infos, layouts, cfg, group=group, check_group=group, device=mesh.device,
                         optimizer_cls=optimizer, defaults=kwargs, options=options, group_of=group_of,
                         scaler=scaler, per_unit=stage == 3)
    if stage == 3:
        engine.gatherer = UnitGatherer(engine, module, specs, has_root)
    model = ZeroModule(module, engine, policy, mesh)
    if reader is not None:
        model.load_checkpoint_pieces(reader, {})
    return model, ShardOptimizer(engine)


def _materialize(module, device, weights, init, stage: int):
    """Before any collective: open and check ``weights`` against the module (ValueError naming the
    tensors), or initialise a meta module. Returns the weights reader, or None. With weights, stage 3 keeps
    the trainable parameters on meta (the engine allocates only this rank's shards); stages 1-2 hold whole
    weights anyway and get their storage here."""
    from pyparallel import materialize

    if weights is not None:
        if init is not None:
            raise ValueError("pass weights= or init=, not both (init initialises a meta model that has no weights)")
        from pyparallel.checkpoint.weights import expected_of, open_weights

        reader = open_weights(weights, module)
        materialize.rebuild_buffers(module, device, loadable=set(expected_of(module)[0]))
        materialize.empty_like_meta([p for p in module.parameters() if not p.requires_grad], device)
        if stage < 3:
            materialize.empty_params(module, device)
        return reader
    if materialize.has_meta(module):
        materialize.initialize(module, device, init)
    elif init is not None:
        raise ValueError("init= only applies to a model built on the meta device (this one has real tensors)")
    return None


def _units(module, wrap_policy, group_of, n_groups):
    """Stage 3's units (root first when it has parameters), each unit's parameters ordered by group."""
    root_spec, specs = assign_parameters(module, select_units(module, wrap_policy))
    if wrap_policy is None:
        root_spec, specs = fold_small_units(root_spec, specs)
    has_root = bool(root_spec.params)
    specs = ([root_spec] if has_root else []) + specs
    for spec in specs:
        order = sorted(range(len(spec.names)), key=lambda i: groups_mod.group_index(spec.names[i], group_of,
                                                                                    n_groups))
        spec.names = [spec.names[i] for i in order]
        spec.params = [spec.params[i] for i in order]
        spec.slots = [spec.slots[i] for i in order]
    return specs, has_root
