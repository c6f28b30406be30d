"""``pyparallel.parallelize``: data, tensor and pipeline parallelism (with ZeRO and mixed precision) on one
mesh, in one call.

    mesh = pyparallel.init(dp=2, tp=2, pp=2)
    model = pyparallel.parallelize(GPT(cfg), mesh, zero_stage=1, param_dtype=torch.bfloat16,
                                   num_microbatches=8, optimizer=torch.optim.AdamW, lr=3e-4)
    for inputs, targets in batches:                 # this DP replica's share of the global batch
        loss = model.step(inputs, targets)          # forward, backward, optimizer step; global mean loss
    # or, for a Hugging Face causal LM, its own convention (unshifted labels, padding mask):
    loss = model.step(ids, labels=labels, attention_mask=mask)

What happens to the model, in order (every rank builds the same full model first, or the same model on
the meta device with ``weights=`` / ``init=``: then no rank ever holds more than its pieces):

1. Tensor parallelism (Shoeybi et al. 2019) inside each stage: ``tensor_parallel.parallelize`` swaps the
   layers for column/row/vocabulary-parallel ones over ``mesh.tp_group`` (built-in plans for the GPT,
   Hugging Face GPT-2 and LLaMA); the loss becomes the vocabulary-parallel cross-entropy.
2. Pipeline parallelism over ``mesh.pp_group``: ``to_blocks`` splits the model into embedding, layers and
   head, and each rank keeps its chunk(s); ``schedule`` is any of the pipeline's ("gpipe", "1f1b",
   "interleaved", "zb-h1", "zbv"). With one stage this is plain micro-batching (gradient accumulation).
3. Data parallelism over ``mesh.dp_group`` by the one sharded engine (``zero.engine.ShardEngine``): plain
   (``zero_stage=0``), or ZeRO stage 1 / 2 / 3 (optimizer state / + gradients / + parameters sharded over
   the DP ranks of the stage; a TP shard is sharded again over DP, as FSDP2 over DTensor does). The
   optimizer is built by the engine over this rank's slices, so it must be element-wise (AdamW, SGD, ...).

ZeRO stage 3 here keeps a stage's weights sharded between steps and gathers them once per step, when the
first micro-batch starts; they stay gathered through the step's micro-batches (forward and backward of
each) and are freed after the optimizer step, the gradients being accumulated and reduce-scattered once --
torchtitan's choice for PP + FSDP. Traffic per step is one all-gather and one reduce-scatter of the stage's
weights (2Ψ/stage, instead of 3Ψ·m if every micro-batch gathered every layer again); the peak holds the
stage's full weights and gradients. ``pyparallel.zero.setup(model, mesh, stage=3)`` gathers layer by layer
instead (data parallelism alone).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from pyparallel import amp, collector, materialize
from pyparallel.combined import buckets
from pyparallel.combined.layout import describe, tp_owners
from pyparallel.combined.pipe import StagePipeline
from pyparallel.data_parallel.ddp import check_same_signature
from pyparallel.mesh import ParallelMesh
from pyparallel.pipeline_parallel import schedules
from pyparallel.pipeline_parallel.schedules import SPLIT_BACKWARD
from pyparallel.zero import accumulate, pieces
from pyparallel.zero import groups as groups_mod
from pyparallel.zero.engine import NONFINITE, EngineConfig, ShardEngine
from pyparallel.zero.optimizer import ShardOptimizer

ParallelOptimizer = ShardOptimizer  # the optimizer of a ParallelModel (one facade for every sharded model)

__all__ = ["ParallelModel", "ParallelOptimizer", "parallelize"]


def _check(model, mesh, zero_stage, optimizer, kwargs, clip_grad_norm, bucket_cap_mb) -> None:
    """Configuration errors, before any collective."""
    if not isinstance(mesh, ParallelMesh):
        raise ValueError(f"mesh must be a pyparallel.ParallelMesh (from pyparallel.init()), got {mesh!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage must be 0 (plain data parallel), 1, 2 or 3, got {zero_stage!r}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"clip_grad_norm must be a positive number or None, got {clip_grad_norm!r}")
    if not bucket_cap_mb or bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    from pyparallel.zero import _check_optimizer  # the element-wise rule is the same as ZeRO's

    _check_optimizer(optimizer, kwargs)
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(f"trainable parameters must share one floating dtype, found {sorted(map(str, dtypes))}")


def _vocab_loss(group, vocab_size):
    """The vocabulary-parallel cross-entropy over the real (unpadded) vocabulary: a target in the padding
    columns is refused, not scored against a -inf logit."""
    from pyparallel.tensor_parallel import vocab_parallel_cross_entropy

    def loss(logits, targets):
        if logits.shape[:-1] != targets.shape and logits.shape[:-1].numel() == targets.numel():
            # a head with its own layout ([b * s, V/t] for [b, s] targets): flat, as one process's loss
            logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        # otherwise in their shape, so that an error names a [row, position]
        return vocab_parallel_cross_entropy(logits, targets, group, vocab_size=vocab_size)

    return loss


def _scaled(loss_fn, scaler):
    def loss(outputs, targets):
        return amp.scale_outputs(loss_fn(outputs, targets), scaler)

    return loss


def _tensor_parallel(model, mesh, tp_plan, loss_fn):
    """Split the layers over the TP group (when tp > 1; tensors on meta stay there, for the engine to load);
    returns the loss function to use."""
    if mesh.tp > 1:
        from pyparallel.tensor_parallel.parallelize import split

        split(model, mesh, plan=tp_plan)
        if loss_fn is None and "vocab_head" in model._pyparallel_tp["plan"].styles.values():
            return _vocab_loss(mesh.tp_group, model._pyparallel_tp["vocab_size"])  # logits stay split by vocabulary
    if loss_fn is None:
        from pyparallel.pipeline_parallel.partition import to_blocks

        loss_fn = to_blocks(model)[1]
    return loss_fn


def _token_vocab(model, ours: bool) -> tuple[int | None, bool]:
    """(vocabulary of the targets, whether targets= are token ids) that a step checks its batch against.
    The pipeline checks the input ids itself, on every stage (``PipelineParallel._check_tokens``), but not
    the targets: it is handed our loss function. Under TP the real vocabulary comes from the split (the
    padded logits have more columns, and an id outside it is no longer an IndexError but a zero logit);
    None: nothing to check. targets= are token ids only for the built-in loss (``ours``); a user's loss_fn
    may take anything."""
    from pyparallel.pipeline_parallel.partition import to_blocks, token_vocab

    tp = getattr(model, "_pyparallel_tp", None)
    return (token_vocab(to_blocks(model)[0])[1] if tp is None else tp["vocab_size"]), ours


def _check_pipeline(model, mesh, schedule: str, m: int, v: int) -> None:
    """The pipeline's configuration errors (schedule, micro-batches, blocks per chunk), raised here before
    the model check; the pipeline's constructor then starts with collectives (handshakes, tied weights)."""
    from pyparallel.pipeline_parallel import partition

    blocks, _ = partition.to_blocks(model)
    schedules.check_schedule(schedule, mesh.pp, v)
    schedules.check_config(schedule, mesh.pp, m, v)
    partition.plan_chunks(blocks, mesh.pp, schedules.chunks_per_stage(schedule, v), None)


def _local_params(pipe, infos, ties, mesh):
    """[(ParamInfo, parameter)] of this stage. A weight tied across stages: a frozen one counts on its first
    stage; a trainable one counts on each stage for the part of it that stage updates (ShardEngine)."""
    named = []
    for p in pipe.parameters():
        info = infos[id(p)]
        if id(p) in ties:
            info.tie_stages = ties[id(p)][1]
            if not p.requires_grad:  # a trainable one is shared out between its stages (ShardEngine)
                info.counted = info.counted and mesh.pp_rank == info.tie_stages[0]
        named.append((info, p))
    return named


def parallelize(model: nn.Module, mesh: ParallelMesh, *, zero_stage: int = 0, param_dtype=None,
                reduce_dtype: torch.dtype = torch.float32, mixed_precision: amp.MixedPrecision | None = None,
                num_microbatches: int | None = None, schedule: str = "1f1b", virtual_stages: int = 1,
                optimizer=torch.optim.AdamW, lr: float | None = None, param_groups=None,
                clip_grad_norm: float | None = None, offload_optimizer: bool = False, tp_plan: dict | None = None,
                loss_fn=None, bucket_cap_mb: float = 25.0, loss_scaler: amp.DynamicLossScaler | None = None,
                activation_checkpointing: bool = False, nonfinite: str = "raise", weights=None, init=None,
                **optimizer_kwargs) -> ParallelModel:
    """Parallelize ``model`` over ``mesh`` (dp x tp x pp) and build its optimizer; see the module doc.

    Args:
        zero_stage: 0 (replicated optimizer), 1 (optimizer state + master sharded over dp), 2 (+ gradients),
            3 (+ weights between steps; gathered once per step, see the module doc).
        param_dtype / reduce_dtype / mixed_precision: the precision policy (``amp.MixedPrecision``): compute
            weights in ``param_dtype`` (None: the model's), gradients summed across ranks and micro-batches
            in ``reduce_dtype``; the master weights and optimizer state are fp32 (fp64 for an fp64 model).
            fp16 turns on dynamic loss scaling (``loss_scaler``).
        num_microbatches: micro-batches per step (default: pp); the batch must divide by it.
        schedule / virtual_stages: the pipeline schedule ("gpipe", "1f1b", "interleaved", ...).
        optimizer, lr, **optimizer_kwargs: an element-wise optimizer class and its default arguments.
        param_groups: ``torch.optim``-style groups over ``model``'s own parameters, as in
            ``pyparallel.zero.setup``; the optimizer's param_groups are these, in order.
        clip_grad_norm: clip by the global gradient norm of the whole model (all three axes).
        offload_optimizer: master weights and optimizer state on the host (ZeRO-Offload).
        tp_plan: a tensor-parallel plan (default: the built-in one for the model).
        loss_fn: ``loss_fn(outputs, targets)`` (mean over the micro-batch); default: token cross-entropy
            (vocabulary-parallel under TP).
        nonfinite: "raise" (default), "skip" or "ignore" a step whose gradients hold inf/NaN (see zero.setup).
        weights: a safetensors file or Hugging Face folder (the model's own names) to load; the model may be
            built on the meta device. It is split (TP, PP) on meta and each rank reads only its pieces: its
            stage's tensors, their TP rows / columns, and under ZeRO its DP shard of those (ZeRO-3 allocates
            no whole weight before the first step's gather). Keys and shapes are a ValueError before any
            collective.
        init: for a meta model without ``weights``: ``init(name, module)`` (default: the model's
            ``init_module``, else ``reset_parameters()``) on one full-size module at a time under
            ``materialize.seed_of(name)``, each rank keeping its
            pieces: the values of the same initialisation in one process (``pyparallel.materialize``).
    """
    kwargs = dict(optimizer_kwargs)
    if lr is not None:
        kwargs["lr"] = lr
    _check(model, mesh, zero_stage, optimizer, kwargs, clip_grad_norm, bucket_cap_mb)
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE)}; got {nonfinite!r}")
    options, group_of = groups_mod.resolve(param_groups, model, optimizer, kwargs)
    policy = mixed_precision or amp.MixedPrecision(param_dtype, reduce_dtype)
    module_dtype = next(p.dtype for p in model.parameters() if p.requires_grad)
    compute = policy.compute_dtype(module_dtype)
    master = torch.float64 if module_dtype == torch.float64 else torch.float32
    reduce = torch.float64 if module_dtype == torch.float64 else policy.reduce_dtype
    if loss_scaler is not None and compute != torch.float16:
        raise ValueError("loss_scaler only applies with param_dtype=torch.float16")
    signature = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    reader = materialize.open_source(model, mesh.device, weights, init)  # before the model changes
    source = (reader, materialize.loadable(model, reader))
    scaler = (loss_scaler or amp.DynamicLossScaler()) if compute == torch.float16 else None
    ours = loss_fn is None
    loss_fn = _tensor_parallel(model, mesh, tp_plan, loss_fn)
    token_vocab = _token_vocab(model, ours)
    owners = tp_owners(model)
    infos = {id(p): describe(n, p, owners.get(id(p)), mesh.tp, mesh.tp_rank) for n, p in model.named_parameters()}
    buffer_names = {id(b): n for n, b in model.named_buffers()}
    if scaler is not None and loss_fn is not None:
        loss_fn = _scaled(loss_fn, scaler)
    m = num_microbatches or mesh.pp
    _check_pipeline(model, mesh, schedule, m, virtual_stages)
    # The first collective, after every configuration error: all ranks must hold the same model (a mismatch
    # would otherwise surface as a size mismatch inside a TP or pipeline collective, or an abort in gloo).
    check_same_signature(signature, mesh.world_group, "parallelize")
    pipe = StagePipeline(model, mesh, schedule=schedule, num_microbatches=m, virtual_stages=virtual_stages,
                         loss_fn=loss_fn, reduce_dp_grads=False,
                         activation_checkpointing=activation_checkpointing, source=source)
    ties = pipe.tie_groups()
    named = _local_params(pipe, infos, ties, mesh)
    world = mesh.dp if zero_stage >= 1 else 1
    # ZeRO-2 reduces once per micro-batch's backward (or W) of a chunk: with several chunks per rank, each
    # bucket holds one chunk's parameters (or those of a set of chunks sharing them) and a chunk's rounds
    # reduce its own buckets only (docs/pipeline.md, "ZeRO-2 keeps no full gradient").
    users = buckets.chunk_users(pipe) if zero_stage == 2 and len(pipe.chunks) > 1 else None
    layouts, tie_groups = buckets.stage_layouts(named, {k: g for k, (g, _) in ties.items()}, world,
                                   max(1, int(bucket_cap_mb * 2**20)), torch.empty((), dtype=compute).element_size(),
                                   group_of, len(options), users)
    rounds = buckets.round_plan(pipe, layouts, users, schedule) if users is not None else None
    # torch's own implementation choices (foreach/fused/...) are respected when given.
    fuse = not any(k in kwargs for k in ("foreach", "fused", "capturable", "differentiable"))
    cfg = EngineConfig(stage=zero_stage, compute_dtype=compute, reduce_dtype=reduce, master_dtype=master,
                       accum_dtype=reduce, reduce_op="sum", overlap=True, gather_per_step=zero_stage == 3,
                       offload=offload_optimizer, fuse=fuse, clip_grad_norm=clip_grad_norm, nonfinite=nonfinite)
    engine = ShardEngine(named, layouts, cfg, group=mesh.dp_group, check_group=mesh.world_group, device=mesh.device,
                         optimizer_cls=optimizer, defaults=kwargs, options=options, group_of=group_of,
                         tie_groups=tie_groups, dp_owner=mesh.dp_rank == 0, scaler=scaler, rounds=rounds)
    if compute != module_dtype:
        pipe.retype(compute)
    if schedule not in SPLIT_BACKWARD:  # weight gradients added straight into the engine's buffers
        accumulate.install(pipe.chunks.values(), engine.accumulating_params())
    parallel = ParallelModel(model, mesh, pipe, engine, policy, buffer_names)
    parallel._token_vocab = token_vocab
    if reader is not None:  # each rank's masters (and frozen parameters) piece by piece, then its weights
        parallel.load_checkpoint_pieces(reader, {})
    return parallel


class ParallelModel:
    """A model trained over a DP x TP x PP mesh (from :func:`parallelize`).

    ``step(inputs, targets)`` runs one training step on this DP replica's share of the batch (identical
    on every TP and PP rank of the replica) and returns the mean loss over the *global* batch.
    ``optimizer`` is a ``torch.optim.Optimizer`` facade (``param_groups`` for LR schedulers, ``step``,
    ``zero_grad``); ``named_parameters()`` yields this rank's tensors under their global names;
    ``full_state_dict()`` gathers every weight, at full size, on every rank. Checkpoints:
    ``pyparallel.checkpoint.save(path, model, model.optimizer, step=...)`` and ``load``, in any layout.
    """

    def __init__(self, module, mesh, pipe: StagePipeline, engine: ShardEngine, policy, buffer_names):
        self.module, self.mesh, self.pipe, self.engine, self.policy = module, mesh, pipe, engine, policy
        self._buffer_names = buffer_names
        # With one micro-batch and one stage, backward is the last of the step: reduce-scatter each bucket
        # as soon as it is complete (stages 1 and 3). Otherwise the micro-batches accumulate and the step
        # reduces once.
        engine.sync = mesh.pp == 1 and pipe.num_microbatches == 1
        self.optimizer = ShardOptimizer(engine)

    # ----------------------------------------------------------------------------------- training

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None, *,
                         labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> float:
        """Forward and backward of one batch (gradients accumulate until ``optimizer.step()``). ``targets``
        aligned with the outputs, or Hugging Face's unshifted ``labels=`` with an optional
        ``attention_mask=`` (see ``PipelineParallel.step`` and docs/combined.md, "Labels")."""
        if inputs.is_floating_point() and inputs.dtype != self.engine.compute_dtype:
            inputs = inputs.to(self.engine.compute_dtype)
        # Local checks first (the same on every rank of a replica), then the TP ranks' shapes, so that a bad
        # batch is a ValueError on every rank before any collective.
        m = self.pipe.num_microbatches
        aligned = self.pipe._validate(inputs, targets, m, labels, attention_mask)
        self._check_tokens(targets, labels)
        self._check_batch(inputs, targets if labels is None else labels, attention_mask)
        with collector.held():  # no rank pauses for a collection between collectives (collector.py)
            self.engine.begin_step()  # ZeRO-3: gather this stage's weights (once per step)
            return self.pipe._step(inputs, aligned, m, attention_mask, time.perf_counter())  # validated above

    _token_vocab: tuple[int | None, bool] = (None, False)

    def _check_tokens(self, targets, labels) -> None:
        """Labels, and targets of the built-in loss, outside the vocabulary (``_token_vocab``): a ValueError
        on every rank of the replica (they all hold this batch) before any collective. The loss checks too,
        but on the last stage only: with pp > 1 the other stages would wait for it."""
        from pyparallel.data.tokens import check_batch_tokens

        vocab, targets_are_ids = self._token_vocab
        check_batch_tokens(None, targets if targets_are_ids else None, labels, None, vocab)

    _MAX_DIMS = 6

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """The ranks of a TP group must step the same batch shape: their activation all-reduces would
        otherwise differ in size, which gloo answers by aborting the process. One fixed-size all-gather of
        the shapes (it cannot mismatch) turns that into a ValueError on every rank of the group. The mask's
        row is -1 when there is none: TP ranks that disagree on masking would compute different models."""
        if self.mesh.tp == 1:
            return
        from pyparallel import comm

        mine = torch.full((3, self._MAX_DIMS + 1), -1, dtype=torch.int64, device=self.mesh.device)
        for row, t in enumerate((inputs, targets, mask)):
            if t is None:
                continue
            dims = list(t.shape)[:self._MAX_DIMS]
            mine[row, 0] = t.dim()
            mine[row, 1:1 + len(dims)] = torch.tensor(dims, dtype=torch.int64, device=mine.device)
        group = self.mesh.tp_group
        everyone = torch.empty((group.size, *mine.shape), dtype=torch.int64, device=mine.device)
        comm.all_gather(everyone.view(-1), mine.view(-1), group)
        if not bool((everyone == mine).all()):
            def shapes(k):
                return [tuple(int(d) for d in everyone[k, r, 1:1 + int(everyone[k, r, 0])])
                        if everyone[k, r, 0] >= 0 else None for r in range(3)]

            seen = "; ".join(f"rank {group.ranks[k]}: inputs {shapes(k)[0]}, targets {shapes(k)[1]}, "
                             f"attention_mask {shapes(k)[2]}" for k in range(group.size))
            raise ValueError(f"the tensor-parallel ranks of one replica must step the same batch, but they got "
                             f"different shapes ({seen}); give every TP rank of a data-parallel replica the same "
                             f"rows (pyparallel.shard_batch(global_batch, mesh))")

    def step(self, inputs: torch.Tensor, targets: torch.Tensor | None = None, *, labels: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None) -> float:
        """Forward, backward and optimizer step; returns the global mean loss (same on every rank)."""
        with collector.held():  # the optimizer's step has collectives too (ZeRO's gathers, the norm)
            loss = self.forward_backward(inputs, targets, labels=labels, attention_mask=attention_mask)
            self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def batch_slice(self, batch_size: int) -> slice:
        """The rows of a global batch of ``batch_size`` samples that this DP replica trains on (the rows
        ``pyparallel.shard_batch`` takes)."""
        from pyparallel.data.split import dp_slice

        return dp_slice(batch_size, self.mesh.dp, self.mesh.dp_rank)

    def train(self, mode: bool = True):
        self.pipe.train(mode)
        return self

    # --------------------------------------------------------------------------------- parameters

    def parameters(self):
        return self.pipe.parameters()

    def named_parameters(self):
        """(global name, local tensor) for this rank's parameters (TP shards, whole replicated tensors)."""
        for p in self.pipe.parameters():
            yield self.engine.infos[id(p)].name, p

    def named_buffers(self):
        seen = set()
        for chunk in self.pipe.chunks.values():
            for b in chunk.buffers():
                if id(b) in self._buffer_names and id(b) not in seen:
                    seen.add(id(b))
                    yield self._buffer_names[id(b)], b

    @property
    def last_grad_norm(self) -> float | None:
        return self.engine.last_grad_norm

    @property
    def loss_scaler(self) -> amp.DynamicLossScaler | None:
        return self.engine.scaler

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size (from the master weights) under its global name, on every rank (a
        collective over the world; it moves the whole model, so for small models, tests and exports)."""
        from pyparallel.checkpoint import gather_full

        return gather_full(self.checkpoint_pieces(), self.mesh.world_group)

    def stats(self, local: bool = False) -> dict:
        """The pipeline's bubble and in-flight statistics (``PipelineParallel.stats``)."""
        return self.pipe.stats(local)

    # -------------------------------------------------------------------------------- checkpoints

    def _piece_buffers(self):
        owner = self.mesh.dp_rank == 0 and self.mesh.tp_rank == 0
        return [(name, buf, owner) for name, buf in self.named_buffers()]

    def checkpoint_pieces(self):
        return pieces.model_pieces(self.engine, self._piece_buffers(), self.mesh.dp_rank == 0)

    def load_checkpoint_pieces(self, reader, manifest) -> None:
        pieces.load_model(self.engine, reader, self._piece_buffers())
