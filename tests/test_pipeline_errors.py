"""Pipeline bad input fails on every rank before any message; a failing stage ends the others with an
error; 1F1B's measured activation memory is GPipe's divided by the micro-batches it keeps."""

import time

import pytest
import torch
import torch.nn as nn
from dist import run
from models import TINY
from test_pipeline import mse, tiny_gpt

import pyparallel
from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch
from pyparallel.pipeline_parallel import PipelineParallel

# ------------------------------------------------------------------------------------------ bad input


def _raises(fn, *needles):
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def bad_input_body():
    """Each mistake raises the same ValueError on every rank before any message, so a good step right
    after still lines up (no stray message is left in a link)."""
    mesh = pyparallel.init(pp=2)
    cfg, make = tiny_gpt(3)
    idx, tgt = synthetic_batch(cfg, 8, 12, seed=1)
    model = make()
    msgs = [
        _raises(lambda: PipelineParallel(make(), mesh, num_microbatches=1), "num_microbatches (1)", "(2)"),
        _raises(lambda: PipelineParallel(GPT(gpt_config("tiny", **{**TINY, "n_layer": 1})), mesh,
                                         schedule="interleaved", virtual_stages=2), "4 chunks", "only 3 blocks"),
        _raises(lambda: PipelineParallel(make(), mesh, schedule="interleaved", virtual_stages=2,
                                         num_microbatches=5), "num_microbatches (5)", "stages (2)"),
        _raises(lambda: PipelineParallel(make(), mesh, schedule="1f1b", virtual_stages=2), "virtual_stages=2"),
    ]
    pipe = PipelineParallel(model, mesh, schedule="1f1b", num_microbatches=4)
    msgs.append(_raises(lambda: pipe.step(idx[:6], tgt[:6]), "batch of 6", "num_microbatches (4)"))
    msgs.append(_raises(lambda: pipe.step(idx, tgt, num_microbatches=1), "num_microbatches (1)"))
    msgs.append(_raises(lambda: pipe.step(idx, tgt[:4]), "(8, 12)", "(4, 12)"))
    msgs.append(_raises(lambda: pipe.step(idx, tgt[:, :5]), "targets of shape (2, 5)"))
    inter = PipelineParallel(make(), mesh, schedule="interleaved", virtual_stages=2, num_microbatches=4)
    msgs.append(_raises(lambda: inter.step(idx, tgt, num_microbatches=3), "num_microbatches (3)"))
    # A stage boundary whose shapes do not fit: 16 features out of stage 0, 32 expected by stage 1.
    seq = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(32, 4))
    bad = PipelineParallel(seq, mesh, num_microbatches=2, loss_fn=mse, boundaries=[0, 2, 3])
    msgs.append(_raises(lambda: bad.step(torch.randn(4, 8), torch.randn(4, 4)), "chunk 1", "stage 1",
                        "(2, 16)"))
    with pytest.raises(ValueError, match="3 strictly increasing"):
        PipelineParallel(seq, mesh, num_microbatches=2, loss_fn=mse, boundaries=[0, 3])
    with pytest.raises(ValueError, match="loss_fn"):
        PipelineParallel(seq, mesh, num_microbatches=2)
    loss = pipe.step(idx, tgt)  # still in lock-step with the other stage
    return msgs, loss


def test_bad_input_raises_on_every_rank():
    (msgs0, loss0), (msgs1, loss1) = run(bad_input_body, 2)
    assert msgs0 == msgs1 and loss0 == loss1


def _set(t, value, pos=(1, 3)):
    t = t.clone()
    t[pos] = value
    return t


def bad_tokens_body():
    """A language model's bad ids, labels and lengths at pp = 2 without tensor parallelism: one process's
    IndexError comes from the embedding (stage 0) or the loss (stage 1), and the other stage waited for a
    message until the group timeout. Each is now a ValueError on both stages before any message; a good step
    right after still lines up."""
    from models import hf_model

    mesh = pyparallel.init(pp=2)
    cfg, make = tiny_gpt(2)  # vocabulary 64, 16 positions
    idx, tgt = synthetic_batch(cfg, 4, 12, seed=1)
    serial = make()
    for bad in (lambda: serial(_set(idx, 64)), lambda: serial(idx, _set(tgt, 64)),
                lambda: serial(torch.zeros(4, 17, dtype=torch.long))):
        with pytest.raises(IndexError):  # what one process does with each of the batches below
            bad()
    pipe = PipelineParallel(make(), mesh, num_microbatches=2)
    msgs = [
        _raises(lambda: pipe.step(_set(idx, 64), tgt), "input id 64 at position (1, 3)", "vocabulary of 64"),
        _raises(lambda: pipe.step(_set(idx, -1), tgt), "input id -1 at position (1, 3)"),
        _raises(lambda: pipe.step(idx, _set(tgt, 64)), "target 64 at position (1, 3)"),
        _raises(lambda: pipe.step(idx, labels=_set(idx, -2)), "label -2 at position (1, 3)"),
        _raises(lambda: pipe.step(torch.zeros(4, 17, dtype=torch.long), torch.zeros(4, 17, dtype=torch.long)),
                "17 tokens", "16 learned positions"),
    ]
    edges = _set(_set(idx, 63, (0, 0)), 0, (2, 5))  # the edges of the vocabulary, -100 and a 16-token batch pass
    loss = pipe.step(edges, _set(tgt, -100))
    full = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    pipe.step(full, full)

    gpt2 = PipelineParallel(hf_model("gpt2"), mesh, num_microbatches=2)  # 64 tokens, 32 learned positions
    msgs.append(_raises(lambda: gpt2.step(_set(idx, 70), labels=idx), "input id 70 at position (1, 3)"))
    msgs.append(_raises(lambda: gpt2.step(torch.zeros(2, 33, dtype=torch.long), labels=torch.zeros(2, 33,
                        dtype=torch.long)), "33 tokens", "32 learned positions"))
    gpt2.step(idx, labels=idx)
    # A user's loss_fn may take anything as targets: they are not checked as ids.
    own = PipelineParallel(make(), mesh, num_microbatches=2,
                           loss_fn=lambda out, t: (out.float().mean(-1) - t).pow(2).mean())
    own.step(idx, torch.full((4, 12), 1000.0))

    # parallelize at tp = 1: the same refusals through ParallelModel (its pipeline is handed our loss).
    pm = pyparallel.parallelize(hf_model("llama"), mesh, lr=1e-2, num_microbatches=2)
    msgs.append(_raises(lambda: pm.forward_backward(_set(idx, 64), labels=idx), "input id 64 at position (1, 3)"))
    msgs.append(_raises(lambda: pm.forward_backward(idx, labels=_set(idx, 64)), "label 64 at position (1, 3)"))
    msgs.append(_raises(lambda: pm.forward_backward(idx, _set(tgt, -7)), "target -7 at position (1, 3)"))
    pm.forward_backward(idx, labels=idx)
    return msgs, loss


def test_bad_tokens_raise_on_every_stage():
    (msgs0, loss0), (msgs1, loss1) = run(bad_tokens_body, 2, deadline_s=120)
    assert msgs0 == msgs1 and loss0 == loss1


class Exploding(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("stage blew up on its third micro-batch")
        return self.lin(x)


def dying_stage_body():
    """Stage 1 fails mid-step and then stays alive but silent (a process that exits instead closes its
    sockets, which the others see at once as a CollectiveError): stage 0 must end with a timeout error
    within the group's timeout, not hang."""
    mesh = pyparallel.init(pp=2, timeout_s=3)
    seq = nn.Sequential(nn.Linear(8, 8), Exploding(8))
    pipe = PipelineParallel(seq, mesh, schedule="1f1b", num_microbatches=4, loss_fn=mse)
    start = time.monotonic()
    try:
        pipe.step(torch.randn(8, 8), torch.randn(8, 8))
    except pyparallel.CollectiveError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    except RuntimeError as exc:
        time.sleep(8)  # keep the connections open until stage 0 has given up
        return "RuntimeError", str(exc), time.monotonic() - start
    return "finished", "", 0.0


def test_dying_stage_ends_the_others_with_an_error():
    out = run(dying_stage_body, 2, deadline_s=60, fresh_after=True)
    assert out[1][:2] == ("RuntimeError", "stage blew up on its third micro-batch")
    kind, msg, elapsed = out[0]
    assert kind == "CollectiveTimeoutError" and "recv" in msg and "'pp'" in msg, msg
    assert elapsed < 8


# --------------------------------------------------------------------------------- measured memory


def memory_body():
    mesh = pyparallel.init(pp=2)
    cfg, make = tiny_gpt(3)
    idx, tgt = synthetic_batch(cfg, 16, 16, seed=1)
    out = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = PipelineParallel(make(), mesh, schedule=schedule, num_microbatches=8,
                                track_activation_memory=True)
        pipe.step(idx, tgt)
        st = pipe.stats()
        out[schedule] = (st["peak_activation_bytes"], st["peak_inflight"])
    return out


def test_1f1b_holds_fewer_activations_than_gpipe():
    out = run(memory_body, 2)[0]
    gp_bytes, gp_inflight = out["gpipe"]
    fb_bytes, fb_inflight = out["1f1b"]
    assert gp_inflight == [8, 8] and fb_inflight == [2, 1]
    # Stage 0 holds 8 micro-batches under GPipe and 2 under 1F1B: about 4x the saved bytes.
    assert 3.0 < gp_bytes[0] / fb_bytes[0] <= 4.5
    assert 6.0 < gp_bytes[1] / fb_bytes[1] <= 8.5
