"""``pyparallel train``: a preset GPT is built on the meta device and trains under TP, PP and ZeRO-3 with the
losses of the whole ``GPT(cfg, seed)`` in one process; resume is bit-exact, a save killed half-way leaves
the previous checkpoint, two torchrun "nodes" train together, and a rank killed under ``torchrun
--max-restarts 1`` restarts and resumes from the last checkpoint with the losses of an uninterrupted run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist import run
from models import train_built_on_meta
from torchrun import result as _result
from torchrun import two_nodes

from pyparallel import train as train_mod

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMON = ["--steps", "5", "--batch", "8", "--seq", "32", "--lr", "3e-3", "--no-progress"]


def _args(*argv):
    return train_mod.build_parser().parse_args([*COMMON, *argv])


def resume_body(root, argv):
    """Uninterrupted; then 3 steps, save, and a fresh model resuming to the end -- in this layout."""
    whole = train_mod.train(_args(*argv))["losses"]
    first = train_mod.train(_args(*argv, "--steps", "3", "--checkpoint-dir", root))
    resumed = train_mod.train(_args(*argv, "--checkpoint-dir", root, "--resume"))
    return whole, first["losses"], resumed["start"], resumed["losses"]


@pytest.mark.parametrize("layout", [["--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "2"],
                                    ["--tp", "2", "--dp", "2", "--zero", "2", "--dtype", "bf16"]])
def test_resume_is_bit_exact(tmp_path, layout):
    whole, first, start, resumed = run(resume_body, 4, str(tmp_path / "ckpt"), layout)[0]
    assert start == 3
    assert first + resumed == whole  # equal, not close: same layout, same arithmetic
    assert whole[-1] < whole[0]


def layout_body(argv):
    return train_built_on_meta(_args(*argv))["losses"]


def one_process(argv):
    """The same AdamW steps on ``GPT(cfg, seed)`` built whole in one process."""
    import torch

    from pyparallel import data

    args = _args(*argv)
    tokens, vocab, _ = train_mod.encode_text(args)
    model = train_mod.build_model(args, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    losses = []
    for step in range(args.steps):
        idx, tgt = data.batch(tokens, step, args.batch, args.seq, seed=args.seed)
        loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2", "--micro-batches", "2"],
                                    ["--pp", "2", "--micro-batches", "4", "--schedule", "zb-h1"],
                                    ["--pp", "2", "--micro-batches", "4", "--schedule", "zbv", "--gc-every", "2"],
                                    ["--dp", "2", "--zero", "3"]],
                         ids=["tp2", "pp2", "pp2-zb-h1", "pp2-zbv", "zero3-dp2"])
def test_a_preset_gpt_is_built_on_meta_and_trains_as_one_process(layout):
    import torch

    seed = ["--steps", "3", "--seed", "4"]
    losses = run(layout_body, 2, [*seed, *layout])[0]  # asserts that no rank built the model off meta
    want = one_process(seed)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _cli(*argv, env=None, timeout=240):
    cmd = [sys.executable, "-m", "pyparallel.cli", "train", *COMMON, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=timeout,
                          cwd=ROOT)


def _metrics(path) -> dict[int, float]:
    """step -> loss, the last record of each step (a restarted run logs some steps twice)."""
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]
    return out


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = ["--dp", "2", "--checkpoint-dir", str(ckpt), "--save-every", "2", "--metrics", str(metrics)]
    crashed = _cli(*args, env={"PYPARALLEL_FAULT": "rank=0,step=4,where=save"})
    assert crashed.returncode != 0, crashed.stdout + crashed.stderr
    assert "injected fault on rank 0 at save 4" in crashed.stderr
    assert (ckpt / ".tmp-step-00000004").is_dir() and not (ckpt / "step-00000004").exists()
    assert (ckpt / "latest").read_text().strip() == "step-00000002"
    before = _metrics(metrics)
    assert sorted(before) == [0, 1, 2, 3]
    resumed = _cli(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = _result(resumed.stdout)
    assert out["start"] == 2
    assert out["losses"][:2] == [before[2], before[3]]  # the same steps again, bit for bit
    assert (ckpt / "latest").read_text().strip() == "step-00000005"


def _torchrun(extra, argv, env=None):
    return [sys.executable, "-m", "torch.distributed.run", *extra, "-m", "pyparallel.cli", "train", *COMMON, *argv]


@pytest.fixture(scope="module")
def uninterrupted():
    """The losses of `pyparallel train --dp 2` (spawned by pyparallel.launch), shared by the tests below."""
    local = _cli("--dp", "2")
    assert local.returncode == 0, local.stderr[-3000:]
    return _result(local.stdout)["losses"]


def test_two_torchrun_nodes_train_together(uninterrupted):
    outs = two_nodes(lambda rdzv: _torchrun(rdzv, ["--dp", "2"]), ENV, ROOT)
    results = [_result(o) for o in outs if "RESULT " in o]
    assert len(results) == 1 and results[0]["world_size"] == 2 and results[0]["layout"]["dp"] == 2
    assert results[0]["losses"] == uninterrupted  # the same arithmetic as two local processes


def test_torchrun_restarts_a_killed_rank_and_resumes(tmp_path, uninterrupted):
    ckpt, metrics, marker = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "failed-once"
    argv = ["--dp", "2", "--checkpoint-dir", str(ckpt), "--save-every", "2", "--resume", "--metrics", str(metrics)]
    extra = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5"]
    fault = {"PYPARALLEL_FAULT": f"rank=1,step=3,where=step,marker={marker}"}
    proc = subprocess.run(_torchrun(extra, argv), capture_output=True, text=True, env={**ENV, **fault},
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert marker.exists()  # the first attempt really lost rank 1 at step 3
    out = _result(proc.stdout)
    assert out["start"] == 2 and len(out["losses"]) == 3  # the second attempt resumed from step-2
    want = uninterrupted
    assert out["losses"] == want[2:]
    logged = _metrics(metrics)
    assert [logged[s] for s in range(5)] == want
