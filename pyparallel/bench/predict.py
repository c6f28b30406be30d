"""What the planner predicts for one rank of a bench row, called with what the bench really trains.

The bench trains fp32 weights with AdamW (16 bytes per parameter: 4 weights + 4 grads + 8 for m and v,
no master copy), so the planner is asked for dtype "fp32" and optimizer "adamw"; asking for its bf16
default would predict the same 16 bytes per parameter but half the activations and traffic. With
``--dtype bf16`` the planner is asked for "bf16", whose mixed-precision model (Rajbhandari et al.'s 2 + 2 + 12
bytes) reduces gradients in bf16 where the bench's rows reduce them in fp32: their states and traffic come
out above the prediction, which the flags show. The model is
the planner's :class:`~pyparallel.planner.ModelSpec` of the built-in GPT's shape; a rank's parameters are
its pipeline stage's share (embeddings on the first, final norm and a copy of the tied head on the last)
divided by tp, as in the planner's search.

On top of the planner's model states, activations and buffers, a rank built by ``pyparallel.parallelize``
(TP, PP) holds one transient of the vocabulary matrix at its peak (:func:`vocab_transient_bytes`), measured
on CPU (benchmarks/memory.py, 152.8M GPT), and a stage holding a weight tied across stages keeps the
optimizer state of its half only (:func:`tied_state_saving_bytes`); neither is part of ``plan``'s search,
whose results stay as published.
"""

from __future__ import annotations

from pyparallel import shm
from pyparallel.pipeline_parallel.schedules import SPLIT_BACKWARD
from pyparallel.planner import ModelSpec, bubble_fraction, model_state_bytes, traffic
from pyparallel.planner import memory as pmem
from pyparallel.planner.search import Problem, SearchOptions, evaluate, stage_layers, stage_params
from pyparallel.planner.specs import TrainSpec, resolve_cluster

DTYPE = "fp32"
OPTIMIZER = "adamw"
BUCKET_MB = 25.0  # pyparallel.DataParallel's default, as the planner assumes
# The GPT's attention is F.scaled_dot_product_attention, whose fused kernels (flash attention on CPU,
# flash or memory-efficient on GPU) keep no s×s scores, softmax or dropout mask for backward: they
# recompute them. That is the planner's "selective" case (Korthikanti et al. 2022, section 4.2), which
# drops exactly the 5·a·s/h term; asking for "none" would predict the scores of an unfused attention.
ATTENTION_AS = "selective"


def model_spec(cfg) -> ModelSpec:
    """The planner's view of a ``GPTConfig`` (the key projection's missing bias is n_layer·n_embd
    parameters the planner counts in excess: under 0.1% for the bench models)."""
    return ModelSpec(name="gpt", layers=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head, vocab=cfg.vocab_size,
                     kv_heads=cfg.n_kv_head, ffn=cfg.ffn_mult * cfg.n_embd, positions=cfg.block_size,
                     tied=cfg.tie_embeddings, bias=cfg.bias, default_seq_len=cfg.block_size)


def _accumulates_in_place(spec, dtype: str) -> bool:
    """Whether the rank's plain Linear / Embedding layers add their weight gradients straight into the
    engine's buffer (``pyparallel.zero.accumulate``: no tensor-parallel layers, no split backward, and an
    accumulation buffer of the weights' own dtype)."""
    return spec.tp == 1 and spec.schedule not in SPLIT_BACKWARD and dtype == "fp32"


def vocab_transient_bytes(spec, model: ModelSpec, seq: int, micro: int, stage: int, dtype: str = DTYPE) -> float:
    """What a ``pyparallel.parallelize`` rank holding the embedding or the LM head keeps for a moment beyond
    its states and saved activations, at the larger of two instants (never both at once):

    * backward: the vocabulary matrix's dense gradient, V·h/t elements, computed whole (the LM head's
      ``dY^T X``, the embedding's scatter of its rows) before autograd adds it into the engine's preallocated
      flat gradient, which already counts in the states -- except where the layers add it into that buffer
      themselves (``_accumulates_in_place``);
    * forward of the loss, on the last stage: the logits beside the ones the planner's output term counts --
      two more under TP (the vocabulary-parallel cross-entropy's shifted logits and their exponentials,
      s·b·V/t each), one without (``F.cross_entropy``'s log-softmax).

    Measured at 152.8M (batch 4 × 128, fp32): TP rank 1549 MiB = 1480 predicted without this + 98 (the two
    loss copies); before the in-place accumulation PP's last stage was 1778 = 1608 + 147 + 23 (the head's
    gradient). 0 for the other rows (ZeRO-3 without a pipeline counts its root unit's gradients in
    ``buffer_bytes`` already)."""
    if spec.is_peer or (spec.tp == 1 and spec.pp == 1) or (spec.zero == 3 and spec.dp > 1 and spec.pp == 1):
        return 0.0
    w = pmem.DTYPE_BYTES[dtype]
    tp, last = spec.tp, stage == spec.pp - 1
    if stage != 0 and not last:
        return 0.0
    grad = 0.0 if _accumulates_in_place(spec, dtype) else model.vocab * model.hidden / tp * w
    loss = (2 if tp > 1 else 1) * seq * micro * model.vocab / tp * w if last else 0.0
    return max(grad, loss)


def tied_state_saving_bytes(spec, model: ModelSpec, stage: int) -> float:
    """AdamW state a stage does not keep for a weight tied across stages: the stages holding the tied
    embedding / LM head (the first and the last) each keep the two fp32 moments of half of it
    (``pyparallel.zero.engine``), on top of ZeRO's sharding over dp."""
    if spec.is_peer or spec.pp == 1 or not model.tied or stage not in (0, spec.pp - 1):
        return 0.0
    moments = 8  # AdamW's exp_avg and exp_avg_sq, fp32, per element
    return model.vocab * model.hidden / spec.tp * moments / 2 / (spec.dp if spec.zero >= 1 else 1)


def predict_rank(spec, cfg, batch: int, seq: int, microbatches: int, stage: int, on_cpu: bool,
                 dtype: str = DTYPE) -> dict:
    """Planner figures for the rank on pipeline stage ``stage`` of ``spec``.

    ``model_state_bytes`` counts what lives in the memory the bench measures: on a CPU run that includes
    what ZeRO-Offload moves to host memory (the planner's ``cpu`` part), on a GPU run it does not.
    ``peak_bytes`` is model states + activations + communication buffers (the planner's per-GPU total)
    + the vocabulary transient of a TP / PP rank (:func:`vocab_transient_bytes`); on a CPU run our rows' buffers
    include the pages of the dp and tp groups' shared-memory transport (:func:`pyparallel.shm.touched_bytes`;
    the PyTorch and DeepSpeed peers do not use it).
    """
    model = model_spec(cfg)
    dp, tp, pp = spec.dp, spec.tp, spec.pp
    m = microbatches if pp > 1 else 1
    micro = batch // dp // m
    v = spec.virtual if spec.schedule == "interleaved" else 1
    layers = stage_layers(model.layers, pp, stage)
    params_rank = stage_params(model, pp, stage) / tp
    states = model_state_bytes(params_rank, spec.planner_strategy, dp, dtype, OPTIMIZER, spec.offload)
    state_total = states["total"] + (states["cpu"] if on_cpu else 0)
    if on_cpu or not spec.offload:
        state_total -= tied_state_saving_bytes(spec, model, stage)
    act = pmem.stage_activation_bytes(model, seq, micro, tp, pp, stage, layers, m, spec.schedule, v,
                                      recompute=ATTENTION_AS, dtype=dtype)
    p2p = micro * seq * model.hidden * pmem.DTYPE_BYTES[dtype]
    root = (model.embedding_params() + model.head_params()) / tp
    buffers = pmem.buffer_bytes(params_rank, model.layer_params() / tp, spec.zero, dp, dtype, BUCKET_MB, p2p, pp,
                                root)
    phases = traffic.dp_phases(params_rank, spec.zero, dp, dtype, m, BUCKET_MB * 2**20, pp=pp)
    phases += traffic.tp_phase(layers, seq, micro, model.hidden, tp, m, dtype)
    phases += traffic.pp_phase(seq, micro, model.hidden, pp, m, tp, dtype=dtype, virtual_stages=v)
    comm = traffic.summarize(phases)
    transient = vocab_transient_bytes(spec, model, seq, micro, stage, dtype)
    if on_cpu and not spec.is_peer:  # gloo on one host: our dp and tp groups' shared-memory transport (shm.py)
        # The largest dp message, in fp32 (reductions): a gradient bucket, or under ZeRO-3 a unit (a block,
        # or the root with the embedding and head), which is what it gathers and reduce-scatters at a time.
        unit = max(model.layer_params() / tp, root) if spec.zero == 3 else BUCKET_MB * 2**20 / 4
        largest = min(unit, params_rank) * 4
        buffers += (shm.touched_bytes(dp, largest) if dp > 1 else 0) + (
            shm.touched_bytes(tp, p2p) if tp > 1 else 0)
    return {
        "model_state_bytes": int(state_total),
        "activation_bytes": int(act["total"]),
        "buffer_bytes": int(buffers),
        "transient_bytes": int(transient),
        "peak_bytes": int(state_total + act["total"] + buffers + transient),
        "comm_bytes_per_step": int(round(comm["total"])),
        "comm_by_axis": {k: int(round(comm[k])) for k in ("dp", "tp", "pp")},
        "bubble_fraction": bubble_fraction(pp, m, spec.schedule, v),
        "params_rank": params_rank,
    }


def predict_step_time(spec, cfg, batch: int, seq: int, microbatches: int, cluster: str,
                      dtype: str = DTYPE) -> float:
    """The planner's step time for this layout on the ``cluster`` preset ("cpu": gloo processes, 0.1
    TFLOP/s each at efficiency 0.5): compute over the processes, stretched by the bubble, plus the traffic
    it cannot hide (docs/planner.md, "Time")."""
    m = microbatches if spec.pp > 1 else 1
    v = spec.virtual if spec.schedule == "interleaved" else 1
    train = TrainSpec(seq_len=seq, global_batch=batch, micro_batch=batch // spec.dp // m, dtype=dtype,
                      optimizer=OPTIMIZER, recompute=ATTENTION_AS, schedule=spec.schedule, virtual_stages=v)
    problem = Problem(model_spec(cfg), train, resolve_cluster(cluster), SearchOptions(gpus=spec.world))
    cand = evaluate(problem, spec.dp, spec.tp, spec.pp, spec.zero, spec.offload, train.micro_batch, m)
    return cand.step_time_s
