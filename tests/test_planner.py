"""The planner's cost model against the papers' own numbers, its search, and the `pyparallel plan` CLI."""

from __future__ import annotations

import json
import sys
import types

import pytest

from pyparallel.cli import main
from pyparallel.planner import (
    MODEL_PRESETS,
    ModelSpec,
    PlanError,
    SearchOptions,
    TrainSpec,
    activation_bytes,
    activation_bytes_per_layer,
    bubble_fraction,
    comm_bytes_per_step,
    in_flight_microbatches,
    load_hf_config,
    model_state_bytes,
    plan,
    resolve_cluster,
)
from pyparallel.planner.search import TIE, rank_key

# ----------------------------------------------------------------------------------- model states (ZeRO)


def test_zero_paper_figure_7_5b_on_64_gpus():
    # Rajbhandari et al. 2020, figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB.
    strategies = ("ddp", "zero1", "zero2", "zero3")
    got = [round(model_state_bytes(7.5e9, s, dp=64)["total"] / 1e9, 1) for s in strategies]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_model_state_parts_and_offload():
    psi, n = 1e9, 8
    z2 = model_state_bytes(psi, "zero2", dp=n)
    assert (z2["params"], z2["grads"], z2["master"], z2["optimizer"]) == (2e9, 2e9 / n, 4e9 / n, 8e9 / n)
    off = model_state_bytes(psi, "zero2", dp=n, offload=True)
    assert off["cpu"] == 12e9 / n and off["optimizer"] == off["master"] == 0
    assert off["total"] == 2e9 + 2e9 / n  # GPU keeps 16-bit weights and its gradient shard
    ddp_off = model_state_bytes(psi, "ddp", dp=n, offload=True)
    assert ddp_off["cpu"] == 12e9  # nothing sharded: the whole optimizer moves


def test_model_states_fp32_and_sgd():
    fp32 = model_state_bytes(1e9, "ddp", dtype="fp32", optimizer="adam")
    assert (fp32["params"], fp32["grads"], fp32["master"], fp32["optimizer"]) == (4e9, 4e9, 0, 8e9)
    assert fp32["total"] == 16e9
    sgd = model_state_bytes(1e9, "ddp", dtype="bf16", optimizer="sgd")
    assert sgd["total"] == (2 + 2 + 4 + 4) * 1e9
    with pytest.raises(ValueError, match="unknown strategy"):
        model_state_bytes(1e9, "zero4")


# ---------------------------------------------------------------------------- activations (Korthikanti)

# GPT-3 175B shapes: s = 2048, b = 1, h = 12288, a = 96, so s·b·h = 25,165,824 and 5·a·s/h = 80.
SBH = 2048 * 12288


@pytest.mark.parametrize("kwargs, expected", [
    ({}, SBH * (34 + 80)),                                                   # 2,868,903,936
    ({"tp": 8}, SBH * (10 + 24 / 8 + 80 / 8)),                               # 578,813,952
    ({"tp": 8, "sequence_parallel": True}, SBH / 8 * (34 + 80)),             # 358,612,992
    ({"recompute": "selective"}, SBH * 34),
    ({"tp": 8, "recompute": "selective"}, SBH * (10 + 24 / 8)),
    ({"tp": 8, "sequence_parallel": True, "recompute": "selective"}, SBH * 34 / 8),
    ({"recompute": "full"}, 2 * SBH),
    ({"tp": 8, "sequence_parallel": True, "recompute": "full"}, 2 * SBH / 8),
])
def test_activation_bytes_per_layer_closed_form(kwargs, expected):
    assert activation_bytes_per_layer(2048, 1, 12288, 96, **kwargs) == expected


def test_activation_numbers_and_scaling():
    assert activation_bytes_per_layer(2048, 1, 12288, 96) == 2_868_903_936
    assert activation_bytes_per_layer(2048, 1, 12288, 96, tp=8) == 578_813_952
    assert activation_bytes(2048, 1, 12288, 96, layers=96) == 96 * 2_868_903_936
    # Linear in the micro-batch, fp32 doubles the 16-bit figure.
    assert activation_bytes_per_layer(2048, 4, 12288, 96) == 4 * 2_868_903_936
    assert activation_bytes_per_layer(2048, 1, 12288, 96, dtype="fp32") == 2 * 2_868_903_936


def test_pipeline_in_flight_and_bubble():
    assert in_flight_microbatches(0, 4, 8, "1f1b") == 4  # 1F1B: at most p on the first stage
    assert in_flight_microbatches(3, 4, 8, "1f1b") == 1
    assert in_flight_microbatches(0, 4, 8, "gpipe") == 8  # GPipe: all m
    assert in_flight_microbatches(0, 4, 8, "interleaved", 2) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight_microbatches(0, 1, 8, "gpipe") == 1  # no pipeline: accumulation is sequential
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(4, 12, "interleaved", 2) == pytest.approx(3 / 30)
    assert bubble_fraction(1, 12) == 0


# ----------------------------------------------------------------------------------------- traffic


def test_comm_bytes_per_step_ring_volumes():
    psi, n = 1e9, 8
    ddp = comm_bytes_per_step(psi, "ddp", dp=n)["dp"]
    assert ddp == pytest.approx(2 * (n - 1) / n * psi * 2)  # 2Ψ elements (ring), 2 bytes each
    assert comm_bytes_per_step(psi, "zero1", dp=n)["dp"] == pytest.approx(ddp)
    assert comm_bytes_per_step(psi, "zero2", dp=n)["dp"] == pytest.approx(ddp)
    assert comm_bytes_per_step(psi, "zero3", dp=n)["dp"] == pytest.approx(1.5 * ddp)  # 3Ψ
    # Gradient accumulation: DDP reduces once per step, ZeRO-2 once per micro-batch.
    assert comm_bytes_per_step(psi, "ddp", dp=n, num_microbatches=4)["dp"] == pytest.approx(ddp)
    z2 = comm_bytes_per_step(psi, "zero2", dp=n, num_microbatches=4)["dp"]
    assert z2 == pytest.approx((4 + 1) / 2 * ddp)
    assert comm_bytes_per_step(psi, "ddp", dp=n, ring=False)["dp"] == pytest.approx(psi * 2)
    assert comm_bytes_per_step(psi, "ddp", dp=1)["total"] == 0


def test_zero3_under_a_pipeline_moves_one_gather_and_one_reduce_scatter_per_step():
    # pyparallel.parallelize gathers a stage's weights once per step under pp > 1 (torchtitan's PP + FSDP):
    # 2Ψ(N-1)/N per step whatever the micro-batches and the recompute, like ZeRO-1, not 3Ψ per micro-batch.
    psi, n = 1e9, 4
    zero1 = comm_bytes_per_step(psi, "zero1", dp=n, pp=2, num_microbatches=8)["dp"]
    for m in (1, 8):
        assert comm_bytes_per_step(psi, "zero3", dp=n, pp=2, num_microbatches=m)["dp"] == pytest.approx(zero1)
    assert comm_bytes_per_step(psi, "zero3", dp=n, num_microbatches=8)["dp"] == pytest.approx(8 * 1.5 * zero1)
    # During the step it holds the stage's full weights and gradients: buffers of 2 x 2 bytes per parameter.
    from pyparallel.planner.memory import buffer_bytes
    assert buffer_bytes(psi, 1e7, 3, n, "bf16", bucket_mb=0, pp=2) == pytest.approx(4 * psi)
    assert buffer_bytes(psi, 1e7, 3, n, "bf16", bucket_mb=0, pp=1) == pytest.approx(4 * 1e7)


def test_comm_bytes_tensor_and_pipeline():
    s, b, h = 1024, 2, 1024
    tp = comm_bytes_per_step(0, tp=2, layers=3, hidden=h, seq_len=s, micro_batch=b)
    # Megatron: 4 all-reduces of b·s·h per layer (2 forward, 2 backward), ring factor 2(t−1)/t = 1.
    assert tp["tp"] == 3 * 4 * (b * s * h * 2)
    pp = comm_bytes_per_step(0, pp=4, hidden=h, seq_len=s, micro_batch=b, num_microbatches=8)
    assert pp["pp"] == 8 * 2 * (b * s * h * 2)  # one activation forward, one gradient back per micro-batch


# -------------------------------------------------------------------------------- parameter counting


GPT2_CONFIG = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
               "n_positions": 1024, "n_inner": None, "activation_function": "gelu_new"}


def test_gpt2_small_parameter_count(tmp_path):
    assert MODEL_PRESETS["gpt2-small"].num_params() == 124_439_808  # nanoGPT's count, with wpe
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2_CONFIG))
    spec = load_hf_config(str(path))
    assert (spec.layers, spec.hidden, spec.positions, spec.tied) == (12, 768, 1024, True)
    assert spec.num_params() == 124_439_808


def test_llama_parameter_counts(tmp_path):
    assert MODEL_PRESETS["llama-7b"].num_params() == 6_738_415_616
    assert MODEL_PRESETS["llama-70b"].num_params() == 68_976_648_192  # grouped-query attention, 8 KV heads
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(str(tmp_path / "config.json")).num_params() == 6_738_415_616


def test_model_spec_rejects_inconsistent_shapes():
    with pytest.raises(PlanError, match="not divisible by 7 heads"):
        ModelSpec("bad", layers=2, hidden=64, heads=7, vocab=100).validate()
    with pytest.raises(PlanError, match="key/value heads"):
        ModelSpec("bad", layers=2, hidden=64, heads=8, kv_heads=3, vocab=100).validate()


# ------------------------------------------------------------------------------------------- search


def _plan(model, gpus, cluster="a100-80g", **train):
    spec = MODEL_PRESETS[model]
    tr = TrainSpec(seq_len=train.pop("seq_len", spec.default_seq_len), **train)
    return plan(spec, tr, resolve_cluster(cluster), SearchOptions(gpus=gpus))


def test_small_model_gets_ddp_over_all_gpus():
    result = _plan("gpt2-small", 8, global_batch=256)
    best = result.best
    assert (best.zero_stage, best.dp, best.tp, best.pp, best.offload) == (0, 8, 1, 1, False)
    assert "fits on one GPU" in result.reason and "Runner-up" in result.reason
    assert best.memory_bytes["total"] <= result.problem.usable_bytes


def test_single_gpu_flat_efficiency_is_flops_over_rate():
    # --efficiency replaces the compute model by one rate: on one GPU the step is exactly the executed GEMM
    # FLOPs (forward + two backward GEMMs each: ×3) over 0.4 × peak. Per layer 24·T·h² (QKV, projection,
    # 4h MLP) + 4·T·s·h (attention core), plus the tied head 2·T·h·V; T tokens.
    best = _plan("gpt2-small", 1, global_batch=8, efficiency=0.4).best
    spec, T, s = MODEL_PRESETS["gpt2-small"], 8 * 1024, 1024
    h, L, V = spec.hidden, spec.layers, spec.vocab
    flops = 3 * (L * (24 * T * h * h + 4 * T * s * h) + 2 * T * h * V)
    assert best.comm_bytes_per_step == 0 and best.recompute == "none"
    assert best.step_time_s == pytest.approx(flops / (0.4 * 312e12), rel=1e-9)


def test_7b_on_8_a100_40g_needs_zero():
    spec = ModelSpec.from_params(7_500_000_000)
    result = plan(spec, TrainSpec(seq_len=2048, global_batch=256), resolve_cluster("a100-40g"),
                  SearchOptions(gpus=8))
    ddp = [c for c in result.candidates if c.zero_stage == 0]
    assert ddp and not any(c.fits for c in ddp)  # 120 GB of model states
    assert result.best.zero_stage >= 2 and result.best.fits  # ZeRO-1 needs 41 GB > 36 GB usable
    # A real 7B model with recomputation lands on ZeRO as well, with no model parallelism.
    llama = _plan("llama-7b", 8, "a100-40g", global_batch=256, recompute="full")
    assert llama.best.zero_stage >= 1 and (llama.best.tp, llama.best.pp) == (1, 1)
    assert "Plain DDP would need" in llama.reason


def test_tp_stays_inside_a_node_unless_forced():
    model, tr = MODEL_PRESETS["gpt2-medium"], TrainSpec(seq_len=1024, global_batch=64)
    a100 = resolve_cluster("a100-80g")
    normal = plan(model, tr, a100, SearchOptions(gpus=16))
    assert max(c.tp for c in normal.candidates) == 8
    assert any(r["tp"] == 16 and "per node" in r["reason"] for r in normal.rejected)
    forced = plan(model, tr, a100, SearchOptions(gpus=16, allow_cross_node_tp=True))
    assert any(c.tp == 16 for c in forced.candidates)


def test_deep_model_at_scale_combines_axes():
    result = _plan("gpt3-175b", 1024, "h100", global_batch=1024)
    best = result.best
    assert best.tp == 8 and best.pp > 1 and best.dp > 1  # Megatron's own 175B layout family
    assert best.tp * best.pp * best.dp == 1024
    assert "no single axis suffices" in result.reason


def test_ranking_is_by_step_time_among_fitting():
    result = _plan("llama-7b", 8, global_batch=64)
    fitting = [c for c in result.candidates if c.fits]
    buckets = [rank_key(c)[0] for c in fitting]  # step times within TIE (1%) tie, then traffic decides
    assert buckets == sorted(buckets) and result.best is fitting[0]
    assert fitting[-1].step_time_s > fitting[0].step_time_s * (1 + TIE)
    assert all(not c.fits for c in result.candidates[len(fitting):])


# ---------------------------------------------------------------------------------------------- CLI

CANDIDATE_KEYS = {"dp", "tp", "pp", "zero_stage", "offload", "micro_batch", "num_microbatches",
                  "memory_bytes", "fits", "comm_bytes_per_step", "bubble_fraction", "step_time_s", "mfu"}


def test_cli_json_schema(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "llama-7b", "--gpus", "8", "--cluster", "a100-80g", "--global-batch", "64",
               "--json", str(out), "--plain"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Recommended:" in text and "ZeRO" in text
    data = json.loads(out.read_text())
    cands = data["candidates"]
    assert any(c["fits"] for c in cands) and any(not c["fits"] for c in cands)
    for c in cands:
        assert CANDIDATE_KEYS <= c.keys()
        mem = c["memory_bytes"]
        assert set(mem) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
        parts = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"] + mem["buffers"]
        assert mem["total"] == parts and c["dp"] * c["tp"] * c["pp"] == 8
        assert c["fits"] == (mem["total"] <= data["usable_bytes_per_gpu"] + 1)
    rec = data["recommendation"]
    assert rec["candidate"]["fits"] and rec["reason"] and rec["runner_up_step_time_ratio"] >= 1.0 - TIE


def test_cli_explain_prints_formulas(capsys):
    assert main(["plan", "--model", "gpt2-small", "--gpus", "4", "--explain", "--plain"]) == 0
    out = capsys.readouterr().out
    for text in ("Korthikanti", "s·b·h·(34 + 5·a·s/h)", "(p−1)/(m+p−1)", "Rajbhandari", "MFU"):
        assert text in out


def test_cli_params_only_and_explicit_sizes(capsys):
    assert main(["plan", "--params", "7.5B", "--gpus", "64", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["num_params"] == 7_500_000_000
    assert all(c["tp"] == 1 and c["pp"] == 1 for c in data["candidates"])
    assert main(["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--gpus", "2", "--plain"]) == 0
    assert "custom 4×256" in capsys.readouterr().out


@pytest.mark.parametrize("argv, needles", [
    (["--model", "gpt5"], ["unknown model 'gpt5'", "gpt2-small", "llama-70b"]),
    (["--layers", "2", "--hidden", "100", "--heads", "3"], ["not divisible by 3 heads", "--hidden"]),
    (["--model", "llama-70b", "--gpus", "2"], ["does not fit", "smallest per-GPU need", "add GPUs"]),
    (["--model", "gpt2-small", "--tp", "3"], ["--tp 3 does not divide --gpus 8"]),
    (["--model", "gpt2-small", "--global-batch", "0"], ["--global-batch must be positive"]),
    (["--model", "/nonexistent/config.json"], ["cannot read model config"]),
    ([], ["give a model"]),
])
def test_cli_bad_input_exits_2_with_a_message(argv, needles, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    for needle in needles:
        assert needle in err


def test_cli_argparse_errors_exit_2(capsys):
    assert main(["plan", "--cluster", "tpu-v9"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2


def test_cli_delegates_bench_and_train(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("pyparallel.bench.cli")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "pyparallel.bench.cli", fake)
    assert main(["bench", "--gpus", "2", "--quick"]) == 0
    assert seen == [["--gpus", "2", "--quick"]]
    monkeypatch.setitem(sys.modules, "pyparallel.train", None)  # import fails
    assert main(["train", "--foo"]) == 2
    assert "pyparallel train: not available" in capsys.readouterr().err
