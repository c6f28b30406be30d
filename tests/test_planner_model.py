"""The planner's time model piece by piece (compute curve, overlap, schedules, ZeRO-3 gathers), the searched
choices (recompute, sequence parallelism, attention), and the new CLI paths (--max-params, --calibrate)."""

from __future__ import annotations

import json
import math

import pytest

from pyparallel.cli import main
from pyparallel.planner import (
    MODEL_PRESETS,
    ModelSpec,
    SearchOptions,
    TrainSpec,
    bubble_fraction,
    calibrate,
    comm_bytes_per_step,
    plan,
    resolve_cluster,
    steptime,
    traffic,
)
from pyparallel.planner.compute import ComputeModel, layer_times
from pyparallel.planner.search import Problem, evaluate

A100 = resolve_cluster("a100-80g")


def test_gemm_curve_and_roofline():
    cm = ComputeModel.for_cluster(A100, "bf16")
    assert cm.efficiency(math.inf) == A100.gemm_eff
    k = A100.gemm_half_dim
    assert cm.efficiency(k) == pytest.approx(A100.gemm_eff / 2)  # the half-performance size
    big = cm.matmul(8192, 8192, 8192)
    assert big == pytest.approx(2 * 8192**3 / (312e12 * cm.efficiency(8192)))  # compute-bound
    # One head of unfused attention, [2048, 64] @ [64, 2048]: 2·s²·d FLOPs against 2·(2sd + s²) bytes,
    # 60 FLOP/byte, under the 92 of A100's effective rate over its HBM bandwidth: memory-bound.
    head = cm.matmul(2048, 64, 2048, 1, 2, curve=False)
    assert head == pytest.approx(2 * (2 * 2048 * 64 + 2048 * 2048) / (2039e9))
    assert head > 2 * 2048 * 64 * 2048 / (312e12 * A100.gemm_eff)
    flat = ComputeModel.for_cluster(A100, "bf16", flat=0.4)
    assert flat.matmul(2048, 128, 2048, curve=False) == pytest.approx(2 * 2048 * 128 * 2048 / (0.4 * 312e12))


def test_small_per_gpu_gemms_run_below_peak():
    # The same layer split 8 ways runs at a lower efficiency per GPU than unsplit (smaller reduction
    # dimensions, replicated elementwise work): what makes Megatron's efficiency rise with model size.
    cm = ComputeModel.for_cluster(A100, "bf16")
    m = ModelSpec("m", 1, 6144, 48, 51200, fused_attention=False)
    flops = 3 * (24 * 2048 * 6144**2 + 4 * 2048**2 * 6144)  # forward + backward of one layer, b = 1
    one = layer_times(cm, m, 2048, 1, 1, False, "none", "bf16")
    eight = layer_times(cm, m, 2048, 1, 8, False, "none", "bf16")
    eff1, eff8 = flops / one.total / 312e12, flops / 8 / eight.total / 312e12
    assert 0.3 < eff8 < eff1 < A100.gemm_eff


def test_overlap_costs_contention():
    k = steptime.OVERLAP_CONTENTION
    assert steptime.overlapped(10.0, 3.0) == pytest.approx(k * 3.0)  # hidden, but slows compute
    assert steptime.overlapped(1.0, 3.0) == pytest.approx(2.0)  # collective-bound: the excess shows
    assert steptime.overlapped(5.0, 0.0) == 0.0


def test_bubble_schedules_and_uneven_interleaving():
    assert bubble_fraction(4, 12, "zb-h1") == pytest.approx(3 / 15 / 3)  # a third of 1F1B's
    assert bubble_fraction(4, 12, "zbv") == 0.0
    # 105 layers on 35 stages: 3 per stage; v = 2 gives chunks of 2 and 1 layer, paced by the 2-layer one.
    assert bubble_fraction(35, 70, "interleaved", 2, layers_per_stage=3) == pytest.approx(34 / 104 / 1.5)
    assert bubble_fraction(35, 70, "interleaved", 3, layers_per_stage=3) == pytest.approx(34 / 104 / 3)


def _layout(**kw):
    base = dict(dp=8, tp=1, pp=1, zero=0, offload=False, micro_batch=1, num_microbatches=1, recompute="full",
                sequence_parallel=False, schedule="1f1b", virtual_stages=1)
    return steptime.Layout(**{**base, **kw})


def test_dp_reduction_hides_in_backward_only_where_the_engine_reduces_there():
    # pyparallel's engines: DataParallel / zero.setup reduce bucket by bucket in the last micro-batch's
    # backward (no_sync before it), ZeRO-2 in every one; parallelize reduces after the last micro-batch
    # under a pipeline, or with TP and several micro-batches (ShardEngine.finish_reductions).
    bw = steptime.Bandwidths(dp=20.0, tp=200.0, pp=20.0, intra=200.0)
    psi, bucket, long_backward = 1e9, 25 * 2**20, 100.0
    full = traffic.ring_factor("all_reduce", 8) * psi * 2 / 20e9
    last = traffic.ring_factor("all_reduce", 8) * bucket / 20e9
    hidden = steptime.overlapped(long_backward, full - last) + last
    for lay, exposed in ((_layout(num_microbatches=4), hidden), (_layout(tp=2), hidden),
                         (_layout(pp=2, num_microbatches=4), full), (_layout(tp=2, num_microbatches=4), full),
                         (_layout(pp=2, num_microbatches=4, zero=1), full * 0.5)):
        got = steptime.dp_seconds(lay, psi, bw, "bf16", bucket, long_backward)["grad"]
        assert got == pytest.approx(exposed), lay
    zero2 = _layout(pp=2, num_microbatches=4, zero=2)
    assert steptime.reduces_in_backward(zero2)
    rs = traffic.ring_factor("reduce_scatter", 8) * psi * 2 / 20e9
    rs_last = traffic.ring_factor("reduce_scatter", 8) * bucket / 20e9
    assert steptime.dp_seconds(zero2, psi, bw, "bf16", bucket, long_backward)["grad"] == pytest.approx(
        4 * (steptime.overlapped(long_backward, rs - rs_last) + rs_last))


def test_bubble_is_the_fill_and_drain_through_the_other_stages():
    # A pipeline of p stages taking t_j per micro-batch: m·max t_j + the sum of the others (1F1B); the
    # output layer's extra time on the last stage is in m·t_last, not in the other stages' fill and drain.
    def st(t):
        return steptime.StageTimes(f=t / 3, b=t / 3, w=t / 3, compute=t)

    lay = _layout(pp=4, num_microbatches=8, dp=1)
    busy, bubble = steptime.pipeline_seconds(lay, [(st(1.0), 3, 3), (st(1.3), 3, 1)])
    assert busy == pytest.approx(8 * 1.3) and bubble == pytest.approx(3 * 1.0)
    busy, bubble = steptime.pipeline_seconds(lay, [(st(1.0), 3, 4)])  # equal stages: (p − 1)·t
    assert busy == pytest.approx(8.0) and bubble == pytest.approx(3.0)
    inter = _layout(pp=4, num_microbatches=8, dp=1, schedule="interleaved", virtual_stages=3)
    assert steptime.pipeline_seconds(inter, [(st(1.0), 3, 3), (st(1.3), 3, 1)])[1] == pytest.approx(1.0)


def test_zero3_gathers_again_under_full_recompute():
    psi, n = 1e9, 8
    plain = comm_bytes_per_step(psi, "zero3", dp=n)["dp"]
    phases = traffic.dp_phases(psi, 3, n, "bf16", 1, recompute="full")
    assert traffic.summarize(phases)["dp"] == pytest.approx(plain * 4 / 3)  # 4Ψ instead of 3Ψ


def test_zero3_time_is_gather_bound_at_small_micro_batch():
    # Narayanan et al. table 2's shape: at micro-batch 1 a 175B ZeRO-3 step is paced by the gathers, not
    # by compute: halving the compute (micro-batch 2 -> 1) leaves the step time almost unchanged.
    model = ModelSpec("175B", 96, 12288, 96, 51200, positions=2048, fused_attention=False)
    times = {}
    for gpus, mb in ((768, 2), (1536, 1)):
        pb = Problem(model, TrainSpec(seq_len=2048, global_batch=1536, recompute="full"), A100,
                     SearchOptions(gpus=gpus))
        times[mb] = evaluate(pb, gpus, 1, 1, 3, False, mb, 1).step_time_s
    assert times[1] == pytest.approx(times[2], rel=0.05)


def test_recompute_searched_cheapest_that_fits():
    # gpt2-xl (unfused attention) at 1024 tokens, micro-batch 4, ZeRO-3 on 8 × 40 GB: without recomputation
    # the layers keep 36 GB of activations, with selective (no s×s scores) 11 GB.
    spec = MODEL_PRESETS["gpt2-xl"]
    tr = TrainSpec(seq_len=1024, global_batch=32, micro_batch=4)
    res = plan(spec, tr, resolve_cluster("a100-40g"), SearchOptions(gpus=8, tp=1, pp=1, zero_stages=(3,),
                                                                       offload="off"))
    assert res.best.recompute == "selective"
    pb = res.problem
    none = evaluate(pb, 8, 1, 1, 3, False, 4, 1, recompute="none")
    assert not none.fits and none.step_time_s < res.best.step_time_s
    assert "searched" in "\n".join(__import__("pyparallel.planner.report", fromlist=["x"]).summary_lines(res))


def test_fused_attention_default_and_llama_activations():
    # Llama-2-7B at 4k tokens: fused attention keeps no s×s scores, ~18 GB of activations at micro-batch 1
    # (32 layers × 34·s·b·h bytes), where the unfused count would be several times more.
    llama = MODEL_PRESETS["llama-7b"]
    assert llama.fused_attention and not MODEL_PRESETS["gpt2-small"].fused_attention
    pb = Problem(llama, TrainSpec(seq_len=4096, global_batch=8), A100, SearchOptions(gpus=8))
    c = evaluate(pb, 8, 1, 1, 3, False, 1, 1, recompute="none")
    per_layer = 34 * 4096 * 4096
    assert c.memory_bytes["activations"] == pytest.approx(32 * per_layer + 4096 * 4096 + 4 * 4096 * (4096 + 32000))


def test_sequence_parallel_searched_with_tp():
    res = plan(MODEL_PRESETS["llama-13b"], TrainSpec(seq_len=4096, global_batch=64), A100,
               SearchOptions(gpus=8, tp=4, pp=1))
    assert res.best.sequence_parallel  # SP splits the replicated activations and their elementwise work


def test_zero2_and_zero3_combine_with_pipelines():
    res = plan(MODEL_PRESETS["llama-70b"], TrainSpec(seq_len=4096, global_batch=64), A100,
               SearchOptions(gpus=32, tp=4, pp=2, offload="off"))
    stages = {c.zero_stage for c in res.candidates if c.pp == 2}
    assert stages == {0, 1, 2, 3}
    assert not any("ZeRO-2/3 skipped" in r["reason"] for r in res.rejected)


def test_zero_bubble_schedules_are_faster_than_1f1b():
    model = MODEL_PRESETS["llama-13b"]
    steps = {}
    for sched in ("1f1b", "zb-h1", "zbv"):
        tr = TrainSpec(seq_len=4096, global_batch=32, micro_batch=1, schedule=sched)
        pb = Problem(model, tr, A100, SearchOptions(gpus=8))
        steps[sched] = evaluate(pb, 1, 1, 8, 1, False, 1, 32, recompute="selective")
    assert steps["zbv"].step_time_s < steps["zb-h1"].step_time_s < steps["1f1b"].step_time_s
    assert steps["zbv"].memory_bytes["activations"] == steps["1f1b"].memory_bytes["activations"]


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_refuses_seq_len_zero(capsys):
    assert main(["plan", "--model", "gpt2-small", "--seq-len", "0"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len must be positive, got 0" in err and err.count("\n") == 1


def test_cli_summary_says_what_was_assumed(capsys):
    assert main(["plan", "--model", "llama-7b", "--gpus", "8", "--plain", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "fused (flash-style) attention" in out and "none/selective/full searched" in out
    assert "GEMMs at" in out and "host GB/node" in out


def test_max_params_reproduces_zero_table_2(capsys):
    # Rajbhandari et al. 2020, table 2: 32 GB per GPU, 64 GPUs, model states only: DDP 2B, P_os 7.6B,
    # P_os+g 14.4B. (P_os+g+p's 128B ignores the gathered layers ZeRO-3 must hold, which the planner counts.)
    rc = main(["plan", "--params", "1B", "--gpus", "64", "--gpu-memory", "32", "--margin", "0", "--max-params",
               "--offload", "off"])
    assert rc == 0
    out = {line.split()[0] + (" " + line.split()[1] if line.split()[1] == "+" else ""): line
           for line in capsys.readouterr().out.splitlines()[1:]}
    size = {k: float(v.split("B parameters")[0].split()[-1]) for k, v in out.items() if "B parameters" in v}
    assert round(size["DDP"], 1) == 2.0 and round(size["ZeRO-1"], 1) == 7.6 and round(size["ZeRO-2"], 1) == 14.4
    assert 64 < size["ZeRO-3"] < 128 and size["ZeRO-3 +"] > size["ZeRO-3"]


def test_max_params_with_a_shape_grows_layers(capsys):
    assert main(["plan", "--model", "gpt2-medium", "--gpus", "8", "--cluster", "a100-40g", "--max-params"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "growing layers" in lines[0]
    tp_pp = next(x for x in lines if x.strip().startswith("TP × PP"))
    ddp = next(x for x in lines if x.strip().startswith("DDP"))
    grab = lambda s: float(s.split("B parameters")[0].split()[-1])  # noqa: E731
    assert grab(tp_pp) > grab(ddp) > 0


def _fake_bench(tmp_path, truth):
    """A `pyparallel bench --json` file whose step times the planner itself produced on ``truth``."""
    from pyparallel.bench.predict import model_spec
    from pyparallel.models.gpt import gpt_config

    model = model_spec(gpt_config("small-test"))
    rows = []
    for name, dp, tp in (("single", 1, 1), ("ddp", 2, 1), ("tp", 1, 2)):
        r = calibrate.Row(name, dp, tp, 1, 0, False, "1f1b", 1, 0.0)
        rows.append({"strategy": name, "dp": dp, "tp": tp, "pp": 1,
                     "step_time_s": calibrate.predict(model, truth, r, 8, 128, 4)})
    rows.append({"strategy": "torch-ddp", "dp": 2, "tp": 1, "pp": 1, "step_time_s": 1.0})  # peers are ignored
    meta = {"model": "small-test", "overrides": {}, "nprocs": 2, "device": "cpu", "cluster": "cpu", "batch": 8,
            "seq": 128, "steps": 2, "warmup": 1, "microbatches": 4}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return path


def test_calibrate_recovers_efficiency_and_bandwidth(tmp_path, capsys):
    from dataclasses import replace

    cpu = resolve_cluster("cpu")
    truth = replace(cpu, gemm_eff=0.3, intra_bw=cpu.intra_bw * 0.5, inter_bw=cpu.inter_bw * 0.5)
    path = _fake_bench(tmp_path, truth)
    cal = calibrate.calibrate_file(str(path))
    assert cal.overrides["gemm_eff"] == pytest.approx(0.3, rel=1e-3)
    assert cal.overrides["intra_bw"] == pytest.approx(truth.intra_bw, rel=1e-2)
    assert all(r["after_s"] == pytest.approx(r["measured_s"], rel=1e-2) for r in cal.rows)
    saved = tmp_path / "mine.json"
    assert main(["plan", "--model", "gpt2-small", "--gpus", "2", "--calibrate", str(path), "--save-cluster",
                 str(saved), "--plain", "--top", "1"]) == 0
    assert "Calibrated cpu: gemm_eff 0.3" in capsys.readouterr().out
    assert resolve_cluster(str(saved)).gemm_eff == pytest.approx(0.3, rel=1e-3)
    assert main(["plan", "--model", "gpt2-small", "--gpus", "2", "--cluster", str(saved), "--plain"]) == 0


def test_calibrate_rejects_a_file_that_is_not_a_bench_json(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    assert main(["plan", "--model", "gpt2-small", "--calibrate", str(bad)]) == 2
    assert "not a `pyparallel bench --json` file" in capsys.readouterr().err
