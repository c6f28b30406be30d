"""`pyparallel bench`: a short run of every default strategy (and the PyTorch peers) on 2 processes
finishes, writes JSON/Markdown/PNG, and every row equals the single-process reference; bad names exit 2;
the pieces the rows are made of (names, predictions, memory and state counting, flags) are right."""

import json

import pytest
import torch

from pyparallel import cli
from pyparallel.bench import deepspeed_peers, measure, predict, results
from pyparallel.bench import specs as S
from pyparallel.models.gpt import GPT, gpt_config
from pyparallel.planner import model_state_bytes

TINY = ["--model", "tiny", "--batch", "8", "--seq", "16", "--microbatches", "4"]


def _bench(out, *extra):
    paths = {k: out / f"bench.{k}" for k in ("json", "md", "png")}
    argv = ["bench", *TINY, "--steps", "2", "--warmup", "0", "--no-progress", *extra,
            "--json", str(paths["json"]), "--md", str(paths["md"]), "--plot", str(paths["png"])]
    status = cli.main(argv)
    return status, paths, json.loads(paths["json"].read_text())


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """One launch: every default strategy, 2 steps, tiny GPT, 2 processes."""
    return _bench(tmp_path_factory.mktemp("bench"))


def _all_match(data):
    rows = {r["strategy"]: r for r in data["rows"]}
    for name, row in rows.items():
        assert row.get("skipped") is None, f"{name}: {row.get('skipped')}"
        assert row["matches_reference"], f"{name}: {row['losses']} vs {rows['single']['losses']}"
        assert len(row["losses"]) == 2 and row["step_time_s"] > 0
    return rows


def test_every_default_strategy_runs_and_matches_the_reference(short_run):
    status, _, data = short_run
    rows = _all_match(data)
    assert list(rows) == S.default_names(2), data["meta"]["notes"]
    assert status == 0


def test_pytorch_peers_run_and_match_the_reference(tmp_path):
    # One warm-up step: on a CPU memory is then measured in a pass of its own (runner.two_passes).
    status, _, data = _bench(tmp_path, "--strategies", "single,ddp", "--peers", "--warmup", "1", "--steps", "1")
    rows = _all_match(data)
    assert all(r["peak_bytes"] > 0 and r["model_state_bytes"] > 0 for r in rows.values())
    # --peers adds DeepSpeed's rows whenever deepspeed imports (tests/test_bench_deepspeed.py checks them).
    deepspeed = [] if deepspeed_peers.unavailable() else list(S.DEEPSPEED_PEERS)
    assert list(rows) == ["single", "ddp", *S.PEERS, *deepspeed]
    assert rows["torch-ddp"]["ratio"] == pytest.approx(rows["ddp"]["step_time_s"] / rows["torch-ddp"]["step_time_s"])
    assert rows["ddp"]["ratio"] == rows["torch-ddp"]["ratio"] and rows["ddp"]["peer"] == "torch-ddp"
    assert rows["torch-fsdp2"]["ratio"] is None  # its counterpart, zero3, did not run
    # FSDP2 shards parameters, gradients and AdamW state: 16Ψ/N per rank (DDP: 16Ψ).
    assert rows["torch-fsdp2"]["model_state_bytes"] == pytest.approx(rows["ddp"]["model_state_bytes"] / 2, rel=0.01)
    assert status == 0


def test_zero3_layouts_and_the_2d_torch_peer_match_the_reference(tmp_path):
    status, _, data = _bench(tmp_path, "--nprocs", "4", "--strategies", "dp2xtp2-zero3,torch-fsdp2xtp,dp2xpp2-zero3",
                             "--warmup", "1", "--steps", "1")
    rows = _all_match(data)
    assert set(rows) == {"dp2xtp2-zero3", "torch-fsdp2xtp", "dp2xpp2-zero3"}
    assert {k for r in rows["dp2xtp2-zero3"]["ranks"] for k in r["comm_bytes_by_axis"]} >= {"dp", "tp"}
    # ZeRO-3 under a pipeline gathers a stage once per step and reduce-scatters once: the planner predicts
    # exactly that (not one gather per unit, pass and micro-batch), on every rank.
    for rank in rows["dp2xpp2-zero3"]["ranks"]:
        assert rank["comm_bytes_by_axis"]["dp"] == pytest.approx(rank["predicted"]["comm_by_axis"]["dp"], rel=0.01)
    assert status == 0


def test_four_process_layouts_match_the_reference(tmp_path):
    status, _, data = _bench(tmp_path, "--nprocs", "4", "--strategies", "dp2xtp2,dp2xpp2,tp2xpp2")
    rows = _all_match(data)
    assert [(r["dp"], r["tp"], r["pp"]) for r in rows.values()] == [(2, 2, 1), (2, 1, 2), (1, 2, 2)]
    assert {k for r in rows["dp2xtp2"]["ranks"] for k in r["comm_bytes_by_axis"]} >= {"dp", "tp"}
    assert status == 0


def test_zero_bubble_rows_run_and_match_the_reference(tmp_path):
    """pp-zb-h1 and pp-zbv (Qi et al. 2023) train the same GPT as one process (zbv: 4 chunks on 2 ranks)."""
    status, _, data = _bench(tmp_path, "--layers", "4", "--strategies", "single,pp-zb-h1,pp-zbv")
    rows = _all_match(data)
    assert list(rows) == ["single", "pp-zb-h1", "pp-zbv"] and status == 0
    assert S.known(2)["pp-zbv"].virtual == 2 and S.known(2)["pp-zb-h1"].schedule == "zb-h1"


def test_outputs_are_written(short_run):
    _, paths, data = short_run
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["md"].read_text()
    for row in data["rows"]:
        assert f"| {row['strategy']} |" in md


def test_json_has_the_documented_keys(short_run):
    _, _, data = short_run
    assert data["tolerance"] == {"rtol": 1e-4, "atol": 1e-5}
    for row in data["rows"]:
        assert list(row)[:len(results.KEYS)] == results.KEYS
        assert isinstance(row["matches_reference"], bool)
        for key in ("step_time_s", "tokens_per_s", "final_loss", "predicted_step_time_s"):
            assert isinstance(row[key], float)
        for key in ("model_state_bytes", "predicted_model_state_bytes", "predicted_peak_bytes"):
            assert row[key] > 0
        if row["peer_of"]:
            assert "ratio" in row
        else:  # our own traffic is counted; the peers' is not visible to pyparallel.comm
            assert row["comm_bytes_per_step"] is not None
        if row["pp"] > 1 and not row["peer_of"]:
            assert 0 < row["bubble_fraction"] < 1


def test_ddp_row_measures_what_the_planner_predicts(short_run):
    """fp32 AdamW: 16 bytes per parameter on every DDP rank, and 2(N-1)/N·4Ψ bytes on the wire."""
    _, _, data = short_run
    ddp = next(r for r in data["rows"] if r["strategy"] == "ddp")
    psi = GPT(gpt_config("tiny")).num_params()
    n_tensors = len(list(GPT(gpt_config("tiny")).parameters()))
    assert 0 <= ddp["model_state_bytes"] - 16 * psi <= 8 * n_tensors  # + AdamW's scalar step counters
    assert ddp["comm_bytes_per_step"] == 2 * (2 - 1) / 2 * 4 * psi
    assert "states" not in ddp["flags"]


@pytest.mark.parametrize("argv", [["--strategies", "ddp,bogus"], ["--strategies", "dp2xtp2"],
                                  ["--nprocs", "4", "--strategies", "tp3"]])
def test_unknown_strategy_exits_2_with_the_known_names(argv, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "single" in err and "ddp" in err and "zero3-offload" in err


@pytest.mark.parametrize("argv", [["--warmup", "-1"], ["--steps", "0"], ["--nprocs", "0"], ["--bogus-flag"]])
def test_bad_numbers_exit_2(argv):
    assert cli.main(["bench", *argv]) == 2


def test_strategy_that_does_not_fit_the_model_exits_2(capsys):
    assert cli.main(["bench", *TINY, "--heads", "3", "--hidden", "63", "--strategies", "tp"]) == 2
    assert "tp=2 does not divide n_head=3" in capsys.readouterr().err


def test_bf16_runs_the_zero_rows_and_refuses_the_others(capsys):
    assert cli.main(["bench", *TINY, "--dtype", "bf16", "--strategies", "zero1,tp"]) == 2
    err = capsys.readouterr().err
    assert "strategy 'tp' cannot run: --dtype bf16 runs only zero1, zero2" in err
    assert S.dtype_misfit(S.known(2)["ddp"], "bf16") and S.dtype_misfit(S.known(2)["ddp"], "fp32") is None
    assert all(S.dtype_misfit(S.known(2)[n], "bf16") is None for n in ("single", *S.BF16_ROWS))


def test_names_and_layouts():
    assert [n for n, s in S.layouts(4).items() if s.zero == 0] == ["dp2xtp2", "dp2xpp2", "tp2xpp2"]
    assert {n for n, s in S.layouts(4).items() if s.zero} == {f"dp2x{a}2-zero{k}" for a in ("tp", "pp")
                                                            for k in (1, 2, 3)}
    assert "dp2xtp2xpp2" in S.layouts(8)
    assert S.layouts(2) == {}
    four = S.known(4)
    assert (four["dp2xtp2"].dp, four["dp2xtp2"].tp, four["dp2xtp2"].pp) == (2, 2, 1)
    assert four["zero3-offload"].offload and four["zero3-offload"].dp == 4
    assert S.default_names(4)[-5:] == ["dp2xtp2", "dp2xtp2-zero3", "dp2xpp2", "dp2xpp2-zero3", "tp2xpp2"]
    z3 = four["dp2xtp2-zero3"]
    assert (z3.dp, z3.tp, z3.zero) == (2, 2, 3) and four["torch-fsdp2xtp"].peer_of == "dp2xtp2-zero3"
    assert [s.name for s in S.parse("ddp,single,ddp", 2)] == ["ddp", "single"]


def test_peers_are_timed_alternating_with_our_strategy():
    from pyparallel.bench.runner import timing_groups

    groups = [[s.name for s in g] for g in timing_groups(S.parse("single,ddp,zero3,torch-zero1", 2, peers=False))]
    assert groups == [["single"], ["ddp"], ["zero3"], ["torch-zero1"]]  # zero1 not asked for: alone
    groups = [[s.name for s in g] for g in timing_groups(S.parse("ddp,zero3", 2, peers=True))]
    assert groups[:2] == [["ddp", "torch-ddp"], ["zero3", "torch-fsdp2", "deepspeed-zero3"]]
    assert sum(len(g) for g in groups) == len(S.parse("ddp,zero3", 2, peers=True))  # every spec exactly once


def test_prediction_is_the_planner_in_fp32():
    cfg = gpt_config("small-test")
    spec = predict.model_spec(cfg)
    psi = spec.num_params()
    two = S.known(2)
    p = predict.predict_rank(two["zero2"], cfg, 8, 128, 4, stage=0, on_cpu=False)
    assert p["model_state_bytes"] == model_state_bytes(psi, "zero2", 2, "fp32", "adamw")["total"]
    assert p["model_state_bytes"] == round(4 * psi + 12 * psi / 2)
    off = S.known(2)["zero3-offload"]
    gpu = predict.predict_rank(off, cfg, 8, 128, 4, 0, on_cpu=False)["model_state_bytes"]
    cpu = predict.predict_rank(off, cfg, 8, 128, 4, 0, on_cpu=True)["model_state_bytes"]
    assert gpu == round(4 * psi / 2) + round(4 * psi / 2) and cpu == round(16 * psi / 2)
    pp = predict.predict_rank(two["pp-1f1b"], cfg, 8, 128, 4, stage=1, on_cpu=True)
    assert pp["bubble_fraction"] == pytest.approx(1 / 5)
    assert pp["comm_by_axis"]["pp"] == 4 * (2 * 2 * 128 * 128 * 4)  # m × (activation + gradient)


def test_model_states_count_shared_storage_once():
    w = torch.nn.Parameter(torch.randn(100, 10))
    b = torch.nn.Parameter(torch.randn(10))
    flat = torch.zeros(1010)
    w.grad, b.grad = flat[:1000].view(100, 10), flat[1000:]  # gradients as views of one bucket
    opt = torch.optim.AdamW([w, b])
    opt.step()
    got = measure.count_model_states([w, b, w], [opt])
    assert got == {"params": 4040, "grads": 4040, "optimizer": 8080, "total": 16160}


def test_peak_memory_sees_a_large_tensor():
    measure.precise_mode()
    peak = measure.PeakMemory(torch.device("cpu"))
    peak.baseline()
    peak.start()
    x = torch.ones(16 * 2**20 // 4)  # 16 MiB, written so its pages are resident
    del x
    got = peak.peak_bytes()
    assert got is not None and 15 * 2**20 <= got < 24 * 2**20, got  # pages of other objects come and go


def test_flags_and_reference_check():
    assert results._off(100, 111, 0.10) and not results._off(100, 109, 0.10)
    assert results.losses_match([1.0, 2.0], [1.00005, 2.0]) and not results.losses_match([1.0], [1.001])
    assert not results.losses_match([1.0, None], [1.0, 1.0])
    recs = [{"coords": {"dp": d, "tp": t, "pp": 0}, "losses": ls} for d, t, ls in
            [(0, 0, [2.0]), (0, 1, [None]), (1, 0, [4.0]), (1, 1, [None])]]
    assert results.replica_losses(recs) == [3.0]
