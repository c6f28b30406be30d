"""``pyparallel train`` and ``pyparallel plan`` answer a user's mistake with one line and exit status 2,
before any process is spawned where it can be known then, and from inside the ranks (still one line, exit
2) where it cannot; ``--resume`` with a broken ``latest`` falls back to the newest complete step and says so."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyparallel import cli
from pyparallel import train as train_mod

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMON = ["--steps", "2", "--batch", "4", "--seq", "16", "--no-progress"]


def _files(tmp_path):
    (tmp_path / "bad.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("too short")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 not text")
    (tmp_path / "a_file").write_text("x")


# (argv, a phrase the one line must contain): each is refused before a process is started.
BAD = [
    (["--dp", "3", "--nprocs", "2"], "= 3 processes, but --nprocs is 2"),
    (["--tp", "3", "--nprocs", "3"], "n_head (attention heads) = 4"),
    (["--model", "nosuchpreset"], "unknown GPT preset 'nosuchpreset'"),
    (["--model", "{tmp}/bad.json"], "is not a Hugging Face config.json"),
    (["--text", "{tmp}/missing.txt"], "cannot be read as UTF-8 text"),
    (["--text", "{tmp}/empty.txt"], "has 0 byte tokens; --seq 16 needs more than 17"),
    (["--text", "{tmp}/short.txt"], "has 9 byte tokens"),
    (["--text", "{tmp}/binary.txt"], "cannot be read as UTF-8 text"),
    (["--lr", "-1"], "--lr must be >= 0, got -1.0"),
    (["--clip", "-0.5"], "--clip must be >= 0"),
    (["--checkpoint-dir", "{tmp}/a_file"], "is a file, not a folder"),
    (["--nprocs", "0"], "--nprocs must be >= 1, got 0"),
    (["--nprocs", "3", "--tp", "2"], "--nprocs 3 is not divisible by --tp 2 x --pp 1"),
    (["--micro-batches", "0"], "--micro-batches must be >= 1"),
    (["--pp", "8", "--nprocs", "8", "--batch", "8", "--micro-batches", "8"], "the model has only 4 blocks"),
    (["--pp", "4", "--nprocs", "4", "--schedule", "zbv"], "8 chunks"),  # ZBV: two chunks per rank
    (["--pp", "2", "--schedule", "interleaved", "--micro-batches", "3", "--batch", "6"],
     "to be a multiple of the number of pipeline stages (2)"),
    (["--seq", "0"], "--seq must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--resume"], "need --checkpoint-dir"),
    (["--gc-every", "-1"], "--gc-every must be >= 0, got -1"),
]


@pytest.mark.parametrize("argv,phrase", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, phrase):
    import pyparallel

    def no_spawn(*a, **k):
        raise AssertionError("the mistake was not caught before spawning the ranks")

    monkeypatch.setattr(pyparallel, "launch", no_spawn)
    _files(tmp_path)
    argv = [a.format(tmp=tmp_path) for a in argv]
    status = train_mod.main([*COMMON, *argv])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyparallel train: "), err
    assert phrase in lines[0], err


def test_argparse_errors_return_2_not_raise(capsys):
    assert train_mod.main(["--zero", "7"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--seq-len", "0"], ["--model", "nosuch"], ["--gpus", "0", "--model", "gpt2-small"]])
def test_plan_bad_input_exit_2(capsys, argv):
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("pyparallel plan: ") and "Traceback" not in "\n".join(err)


def _cli(*argv):
    cmd = [sys.executable, "-m", "pyparallel.cli", "train", *COMMON, "--nprocs", "2", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, cwd=ROOT)


def test_resume_of_other_model_corrupt_piece_and_broken_latest(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _cli("--checkpoint-dir", str(ckpt), "--save-every", "1")
    assert first.returncode == 0, first.stderr
    assert (ckpt / "latest").read_text().strip() == "step-00000002"

    # Another model: refused before spawning, naming both.
    other = _cli("--checkpoint-dir", str(ckpt), "--resume", "--steps", "3", "--model", "small-test")
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr
    assert "saved by a run with --model 'tiny', this one has --model 'small-test'" in other.stderr

    # 'latest' names a step that is gone: resumes from the newest complete one (step 2) and says so.
    (ckpt / "latest").write_text("step-00000009")
    resumed = _cli("--checkpoint-dir", str(ckpt), "--resume", "--steps", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step-00000002, the newest complete step" in resumed.stderr
    result = json.loads(resumed.stdout.split("RESULT ", 1)[1])
    assert result["start"] == 2 and len(result["losses"]) == 1

    # A piece that no longer matches its checksum can only be found by the ranks: still one line, exit 2.
    piece = sorted((ckpt / "step-00000003").glob("*.safetensors"))[0]
    data = bytearray(piece.read_bytes())
    data[-5] ^= 0xFF
    piece.write_bytes(bytes(data))
    corrupt = _cli("--checkpoint-dir", str(ckpt), "--resume", "--steps", "4")
    assert corrupt.returncode == 2, corrupt.stderr
    lines = corrupt.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in corrupt.stderr, corrupt.stderr
    assert lines[0].startswith("pyparallel train: rank ") and "does not match its checksum" in lines[0]
