"""Per-GPU memory: model states (ZeRO), activations (Korthikanti et al.) and communication buffers.

All figures are bytes on one rank. Model states follow ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 3 and figure 1); activations follow
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (section 4,
table 2), with pipeline in-flight counts from Narayanan et al. 2021 ("Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM").
"""

from __future__ import annotations

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Which model-state parts each ZeRO stage partitions across the data-parallel ranks (ZeRO section 5):
# P_os (stage 1) shards the optimizer state (fp32 master included), P_os+g (stage 2) adds the
# gradients, P_os+g+p (stage 3) adds the parameters.
_SHARDED = {
    0: frozenset(),
    1: frozenset({"optimizer", "master"}),
    2: frozenset({"optimizer", "master", "grads"}),
    3: frozenset({"optimizer", "master", "grads", "params"}),
}
_STRATEGY_STAGE = {"ddp": 0, "zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def zero_stage_of(strategy: str | int) -> int:
    """'ddp' | 'zero1' | 'zero2' | 'zero3' (or 0..3) -> ZeRO stage number."""
    if isinstance(strategy, int) and strategy in _SHARDED:
        return strategy
    try:
        return _STRATEGY_STAGE[str(strategy).lower()]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; use ddp, zero1, zero2 or zero3") from None


def state_bytes_per_param(dtype: str = "bf16", optimizer: str = "adamw") -> dict[str, int]:
    """Bytes per parameter of each model-state part, before any sharding.

    Mixed precision (bf16/fp16) with Adam is ZeRO's K=12 case: 2 (weights) + 2 (grads) + 4 (fp32 master)
    + 8 (fp32 m and v) = 16. fp32 training keeps no master copy: 4 + 4 + 8 = 16. SGD with momentum
    keeps one fp32 buffer instead of two.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use bf16, fp16 or fp32")
    opt = optimizer.lower()
    if opt not in ("adam", "adamw", "sgd"):
        raise ValueError(f"unknown optimizer {optimizer!r}; use adam, adamw or sgd")
    w = DTYPE_BYTES[dtype]
    return {"params": w, "grads": w, "master": 0 if w == 4 else 4, "optimizer": 4 if opt == "sgd" else 8}


def model_state_bytes(num_params: float, strategy: str | int = "ddp", dp: int = 1, dtype: str = "bf16",
                      optimizer: str = "adamw", offload: bool = False) -> dict[str, int]:
    """Model-state bytes per rank under DDP or a ZeRO stage (Rajbhandari et al. 2020, figure 1).

    With Ψ = ``num_params`` and N = ``dp``, mixed-precision Adam gives DDP 16Ψ, ZeRO-1 4Ψ + 12Ψ/N,
    ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N; 7.5e9 parameters on 64 ranks give 120, 31.4, 16.6 and 1.9 GB.
    ``offload`` (ZeRO-Offload, Ren et al. 2021) moves the fp32 master and optimizer state to CPU memory:
    they are reported under ``cpu`` and left out of ``total``, which counts GPU memory only.
    Returns ``{"params", "grads", "optimizer", "master", "cpu", "total"}``; ``optimizer`` excludes the
    master copy.
    """
    stage = zero_stage_of(strategy)
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    per = state_bytes_per_param(dtype, optimizer)
    out = {k: round(b * num_params / (dp if k in _SHARDED[stage] else 1)) for k, b in per.items()}
    out["cpu"] = 0
    if offload:
        out["cpu"] = out["optimizer"] + out["master"]
        out["optimizer"] = out["master"] = 0
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["master"]
    return out


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               dtype: str = "bf16") -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, table 2).

    s·b·h·(34 + 5·a·s/h) without parallelism; s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor parallelism
    of degree t (the 10·s·b·h of layer-norm and dropout inputs stays replicated); s·b·h/t·(34 + 5·a·s/h)
    with sequence parallelism. Selective recompute drops the 5·a·s/h attention term (scores, softmax,
    dropout mask: recomputed); full recompute keeps only the layer input, 2·s·b·h (split by t under
    sequence parallelism). The constants assume 16-bit activations and 1-byte dropout masks; fp32 is
    approximated by doubling.
    """
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        total = 2 * sbh / (t if sequence_parallel else 1)
    else:
        attn = 0 if recompute == "selective" else 5 * a * s * s * b  # = s·b·h · 5as/h
        if sequence_parallel or t == 1:
            total = (34 * sbh + attn) / t
        else:
            total = 10 * sbh + (24 * sbh + attn) / t
    return total * DTYPE_BYTES[dtype] / 2


def activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, layers: int = 1, tp: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none", dtype: str = "bf16") -> float:
    """``layers`` × :func:`activation_bytes_per_layer`: one micro-batch's activations over the layers."""
    return layers * activation_bytes_per_layer(seq_len, micro_batch, hidden, heads, tp, sequence_parallel,
                                               recompute, dtype)


def in_flight_microbatches(stage: int, pp: int, num_microbatches: int, schedule: str = "1f1b",
                           virtual_stages: int = 1) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak.

    GPipe runs every forward before any backward, so each stage holds all m. 1F1B (PipeDream-Flush,
    Narayanan et al. 2021) lets stage i hold at most p − i. Interleaving with v chunks per stage makes
    the first stage hold 1 + (p−1)/(p·v) times more (Korthikanti et al. 2022, section 4.2.3).
    """
    if pp <= 1:
        return 1.0  # no pipeline: gradient accumulation runs micro-batches one after another
    # ZB-H1 and ZB-V keep 1F1B's peak (Qi et al. 2023, 2024): their W passes run inside 1F1B's memory.
    if schedule == "gpipe":
        return float(num_microbatches)
    held = float(min(pp - stage, num_microbatches))
    if schedule == "interleaved":
        held *= 1 + (pp - 1) / (pp * virtual_stages)
    return held


def stage_activation_bytes(model, seq_len: int, micro_batch: int, tp: int, pp: int, stage: int,
                           stage_layers: int, num_microbatches: int, schedule: str = "1f1b",
                           virtual_stages: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", dtype: str = "bf16") -> dict[str, float]:
    """Peak activation bytes on one pipeline stage: its layers, plus the embedding-dropout mask on the
    first stage and the output layer (final norm input and fp32 logits, 4·s·b·(h + V)/t) on the last,
    each times the micro-batches in flight (Korthikanti et al. 2022, section 4.3)."""
    if not model.has_shape:
        return {"per_layer": 0.0, "layers": 0.0, "embedding": 0.0, "output": 0.0, "in_flight": 0.0,
                "total": 0.0}
    s, b, h = seq_len, micro_batch, model.hidden
    per_layer = activation_bytes_per_layer(s, b, h, model.heads, tp, sequence_parallel, recompute, dtype)
    held = in_flight_microbatches(stage, pp, num_microbatches, schedule, virtual_stages)
    split = tp if sequence_parallel else 1
    out = {
        "per_layer": per_layer,
        "layers": stage_layers * per_layer * held,
        "embedding": (s * b * h / split) * held if stage == 0 else 0.0,
        "output": (4 * s * b * (h + model.vocab) / tp) * held if stage == pp - 1 else 0.0,
        "in_flight": held,
    }
    out["total"] = out["layers"] + out["embedding"] + out["output"]
    return out


def gathers_per_step(zero_stage: int, dp: int, pp: int) -> bool:
    """Whether ZeRO-3 runs in pyparallel's pipeline mode: a stage's weights all-gathered once when the
    step's first micro-batch starts, gradients accumulated and reduce-scattered once (``pyparallel.parallel``,
    torchtitan's choice for PP + FSDP), instead of one gather per unit, micro-batch and pass."""
    return zero_stage == 3 and dp > 1 and pp > 1


def buffer_bytes(params_rank: float, layer_params_rank: float, zero_stage: int, dp: int, dtype: str,
                 bucket_mb: float = 25.0, p2p_bytes: float = 0.0, pp: int = 1, root_params_rank: float = 0.0) -> float:
    """Communication buffers: two gradient buckets in flight (DDP all-reduce or ZeRO reduce-scatter;
    25 MiB as in PyTorch DDP), ZeRO-3's gathered current and prefetched unit (``layer_params_rank``: the
    largest unit, in every mode, offload included: 2 × 16-bit = the 4 bytes per parameter of the largest
    layer that DeepSpeed's estimator charges), and a send plus a receive buffer per pipeline boundary.

    ZeRO-3 under a pipeline (``pyparallel.parallelize`` with pp > 1) gathers the stage's weights once per
    step and accumulates full gradients over the micro-batches (:func:`gathers_per_step`): during the step
    it holds the whole stage's compute-dtype weights and gradients, counted here instead of two units.

    ZeRO-3 without a pipeline keeps its *root unit* (``root_params_rank``: the parameters outside the
    layers -- token and position embeddings, final norm, an untied head) gathered from the start of the
    forward into the head's backward, as ``pyparallel.zero.stage3`` does (the tied embedding is read at
    both ends of the forward; the weights go once autograd has released the tensors that read them), and
    holds two root-sized tensors at any time of that backward: the weights beside the head's gradient of
    them, then that gradient beside the embedding's own dense one before autograd sums them (or, untied,
    the flat gradient the unit's views are assembled into). Measured on CPU (benchmarks/memory.py, 152.8M GPT, 4
    ranks) this is most of what the rank holds beyond its 16Ψ/N. The bench's prediction of its own runs
    (``pyparallel.bench.predict``) passes it; ``plan``'s search leaves it at 0 and charges two of the largest
    unit, layer or embedding, as the published ZeRO-3 runs it is held against do (DeepSpeed, which gathers the
    embedding per module, as in Narayanan et al.'s table 2)."""
    w = DTYPE_BYTES[dtype]
    total = 0.0
    if dp > 1:
        total += 2 * min(bucket_mb * 2**20, params_rank * w)
    if gathers_per_step(zero_stage, dp, pp):
        total += 2 * params_rank * w
    elif zero_stage == 3 and dp > 1:
        total += 2 * layer_params_rank * w + 2 * root_params_rank * w
    if pp > 1:
        total += 2 * p2p_bytes
    return total


def host_bytes_per_rank(params_rank: float, zero_stage: int, dp: int, dtype: str = "bf16",
                        optimizer: str = "adamw", offload: bool = False) -> float:
    """Host (CPU) memory one rank needs for ZeRO-Offload: the fp32 master and optimizer state
    (``model_state_bytes``' ``cpu`` part) plus the two staging buffers of pyparallel.zero.offload, a
    gradient landing buffer and the updated 16-bit weights, each of the compute dtype. For mixed-precision
    Adam that is 16 bytes per parameter of the rank's shard: 16Ψ/N per rank, 16Ψ/nodes per node, the
    figure of DeepSpeed's estimator with zero_init and no buffer factor."""
    if not offload:
        return 0.0
    states = model_state_bytes(params_rank, zero_stage, dp, dtype, optimizer, offload=True)
    shard = params_rank / dp if zero_stage >= 1 else params_rank
    return states["cpu"] + 2 * DTYPE_BYTES[dtype] * shard
