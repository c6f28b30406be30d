"""DeepSpeed's ZeRO engine as a `pyparallel bench --peers` row (pyparallel/bench/deepspeed_peers.py): each
of deepspeed-zero1/2/3 and deepspeed-zero3-offload trains the bench GPT on 2 gloo processes and its losses
equal the single-process reference; its traffic comes from DeepSpeed's comms logger and its model states
from the tensors the engine holds. Skipped only when deepspeed does not import."""

import json

import pytest

from pyparallel import cli
from pyparallel.bench import deepspeed_peers
from pyparallel.bench import specs as S
from pyparallel.models.gpt import GPT, gpt_config

_WHY = deepspeed_peers.unavailable()
needs_deepspeed = pytest.mark.skipif(_WHY is not None, reason=f"{_WHY} (pip install deepspeed)")

TINY = ["--model", "tiny", "--batch", "8", "--seq", "16"]


@needs_deepspeed
def test_deepspeed_rows_match_the_reference(tmp_path):
    path = tmp_path / "bench.json"
    names = ["single", "zero1", *S.DEEPSPEED_PEERS]
    # One warm-up step: the comms logger counts it (it is off in the timed steps).
    status = cli.main(["bench", *TINY, "--strategies", ",".join(names), "--warmup", "1", "--steps", "1",
                       "--no-progress", "--json", str(path)])
    rows = {r["strategy"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == names
    for name in S.DEEPSPEED_PEERS:
        row = rows[name]
        assert row.get("skipped") is None, f"{name}: {row.get('skipped')}"
        assert row["matches_reference"], f"{name}: {row['losses']} vs {rows['single']['losses']}"
        assert row["model_state_bytes"] > 0 and row["comm_bytes_per_step"] > 0
    ours = rows["zero1"]["step_time_s"] / rows["deepspeed-zero1"]["step_time_s"]
    assert rows["deepspeed-zero1"]["ratio"] == pytest.approx(ours)
    assert rows["deepspeed-zero3"]["ratio"] is None  # its counterpart, zero3, did not run
    # ZeRO-1 in DeepSpeed all-reduces the whole gradient: at least 2(N-1)/N x 4 bytes x params on the wire.
    psi = GPT(gpt_config("tiny")).num_params()
    assert rows["deepspeed-zero1"]["comm_bytes_per_step"] >= 4 * psi
    # ZeRO-Offload's optimizer is DeepSpeed's compiled CPU Adam, not a torch fallback.
    used = {r["stats"]["optimizer"] for r in rows["deepspeed-zero3-offload"]["ranks"]}
    assert all("DeepSpeedCPUAdam" in u for u in used), used
    assert all("torch.optim" in r["stats"]["optimizer"] for r in rows["deepspeed-zero1"]["ranks"])
    assert rows["zero1"]["peer"] == "deepspeed-zero1"  # no PyTorch peer asked for: DeepSpeed's ratio
    assert status == 0


def test_deepspeed_rows_are_peers_of_our_zero_rows():
    two = S.known(2)
    assert [two[n].peer_of for n in S.DEEPSPEED_PEERS] == ["zero1", "zero2", "zero3", "zero3-offload"]
    assert two["deepspeed-zero3-offload"].offload and two["deepspeed-zero3"].zero == 3
    assert set(S.DEEPSPEED_PEERS) <= set(S.peer_names(2))


def test_config_is_our_rows_hyper_parameters():
    from pyparallel.bench.adapter import Hyper

    hp = Hyper()
    cfg = deepspeed_peers.config(3, True, 4, 2, hp)
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": hp.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                           "weight_decay": hp.weight_decay}}
    assert cfg["gradient_clipping"] == 0.0 and not cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert deepspeed_peers.config(1, False, 4, 2, hp)["optimizer"]["params"]["torch_adam"] is True


@needs_deepspeed
def test_bf16_rows_train_in_bf16_and_match_the_reference_at_its_tolerance(tmp_path):
    """``--dtype bf16``: our ZeRO rows and DeepSpeed's in bf16 with fp32 master weights and reductions; the
    fp32 reference is unchanged, the bf16 losses differ from it by rounding (so they did run in bf16) and
    stay within the stated bf16 tolerance."""
    path = tmp_path / "bench.json"
    names = ["single", "zero1", "zero3", "deepspeed-zero1", "deepspeed-zero3"]
    status = cli.main(["bench", *TINY, "--dtype", "bf16", "--strategies", ",".join(names), "--warmup", "1",
                       "--steps", "2", "--no-progress", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["meta"]["dtype"] == "bf16" and data["tolerance"] == {"rtol": 1e-2, "atol": 1e-3}
    rows = {r["strategy"]: r for r in data["rows"]}
    ref = rows["single"]["losses"]
    for name in names[1:]:
        row = rows[name]
        assert row.get("skipped") is None, f"{name}: {row.get('skipped')}"
        worst = max(abs(a - b) / b for a, b in zip(row["losses"], ref))
        assert 1e-5 < worst < 1e-2 and row["matches_reference"], f"{name}: {row['losses']} vs {ref}"
    assert rows["zero1"]["peer"] == "deepspeed-zero1" and rows["zero1"]["ratio"] > 0
    assert status == 0


def test_bf16_config_reduces_in_fp32():
    from pyparallel.bench.adapter import Hyper

    cfg = deepspeed_peers.config(2, False, 4, 2, Hyper(dtype="bf16"))
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["communication_data_type"] == "fp32" and cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "communication_data_type" not in deepspeed_peers.config(2, False, 4, 2, Hyper())


@pytest.mark.skipif(_WHY is None, reason="deepspeed imports here: nothing is left out")
def test_without_deepspeed_the_rows_are_left_out_with_the_reason(capsys):
    assert cli.main(["bench", *TINY, "--strategies", "deepspeed-zero1"]) == 2
    assert "deepspeed does not import" in capsys.readouterr().err
