"""PipelineParallel equals the unsplit model on the whole batch, for every schedule, within its in-flight
bounds; deadlock-prone traffic finishes. (Bad input: test_pipeline_errors.py; pieces: test_pipeline_units.py.)

Parity uses SGD with momentum, not Adam. Micro-batching alone (in one process, no pipeline) changes the
order in which each weight's gradient is summed; Adam divides every element's update by that element's
own gradient scale, so an element whose gradient is nearly zero turns that rounding into a visible
difference (the 6-layer tiny GPT, accumulated over 4 micro-batches in one process, already misses
assert_close on a few elements after 5 AdamW steps). SGD is linear in the gradient, so a parameter after
5 steps checks every gradient at fp32 tolerance. ``test_adam_matches_one_process_microbatching`` then
checks that with Adam the pipeline equals one process doing the same micro-batching.
"""

import pytest
import torch
import torch.nn as nn
from dist import run
from models import TINY

import pyparallel
from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch
from pyparallel.pipeline_parallel import PipelineParallel

SEQS = [12, 8, 16, 12, 5]  # the sequence length changes between steps
BATCH = 16


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def gpt_data(cfg, batch=BATCH, seqs=SEQS):
    return [synthetic_batch(cfg, batch, s, seed=100 + k) for k, s in enumerate(seqs)]


def reference(make_model, data, make_opt=sgd, micro=1):
    """One process, whole batch (or ``micro`` micro-batches accumulated): losses and final parameters."""
    model = make_model()
    opt = make_opt(model.parameters())
    losses = []
    for idx, tgt in data:
        total = 0.0
        for a, b in zip(idx.tensor_split(micro), tgt.tensor_split(micro)):
            loss = model(a, b) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_pipe(pipe, data, make_opt=sgd, dp_slice=None):
    opt = make_opt(list(pipe.parameters()))
    losses = []
    for idx, tgt in data:
        if dp_slice is not None:
            idx, tgt = idx[dp_slice], tgt[dp_slice]
        losses.append(pipe.step(idx, tgt))
        opt.step()
        opt.zero_grad()
    return losses


def compare(model, pipe, losses, ref):
    """Losses everywhere, and every parameter this rank holds, against the one-process run."""
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    mine = {id(p) for p in pipe.parameters()}
    checked = 0
    for name, prm in model.named_parameters():
        if id(prm) in mine:
            torch.testing.assert_close(prm.detach(), ref_params[name], msg=lambda s, n=name: f"{n}: {s}")
            checked += 1
    assert checked == len(mine)
    return checked


def tiny_gpt(n_layer, **kw):
    cfg = gpt_config("tiny", **{**TINY, "n_layer": n_layer, **kw})
    return cfg, (lambda: GPT(cfg, seed=0))


# --------------------------------------------------------------------------------- parity (processes)


def parity_body(pp, n_layer, configs):
    """Every (schedule, m, v, checkpointing) config trains the tied-embedding GPT for 5 steps of changing
    sequence length; returns per config the stats the test checks."""
    mesh = pyparallel.init(pp=pp)
    cfg, make = tiny_gpt(n_layer)
    data = gpt_data(cfg)
    ref = reference(make, data)
    out = []
    for schedule, m, v, ckpt in configs:
        model = make()
        pipe = PipelineParallel(model, mesh, schedule=schedule, num_microbatches=m, virtual_stages=v,
                                activation_checkpointing=ckpt)
        losses = train_pipe(pipe, data)
        checked = compare(model, pipe, losses, ref)
        assert max(abs(a - b) for a, b in zip(losses, losses[1:])) > 0  # it really trained
        st = pipe.stats()
        out.append({"checked": checked, "peak": st["peak_inflight"], "limit": st["inflight_limit"],
                    "tied": len(pipe._tied), "bubble": st["bubble_measured"]})
    return out


CONFIGS = [(s, m, v, False) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)) for m in (4, 8)]


@pytest.mark.parametrize("pp,n_layer", [(2, 3), (4, 6)])  # 5 blocks on 2 stages; 8 blocks on 4
def test_parity_every_schedule(pp, n_layer):
    results = run(parity_body, pp, pp, n_layer, CONFIGS)
    for rank, per_config in enumerate(results):
        for (schedule, m, v, _), r in zip(CONFIGS, per_config):
            assert r["checked"] > 0
            assert r["tied"] == (1 if rank in (0, pp - 1) else 0)  # wte/lm_head tied across first/last
            peak = r["peak"][rank]
            if schedule == "gpipe":
                assert peak == m
            elif schedule == "1f1b":
                assert peak == pp - rank <= pp
            else:  # interleaved: chunk-micro-batches, Megatron's warm-up + 1
                assert peak == min((pp - rank - 1) * 2 + (v - 1) * pp + 1, m * v)
            assert 0.0 <= r["bubble"] < 1.0


def test_parity_activation_checkpointing():
    configs = [("1f1b", 4, 1, True), ("interleaved", 4, 2, True)]
    run(parity_body, 2, 2, 3, configs)


def dp_body(reduce_dp, pp=2):
    """dp x pp: each replica steps on its share of the batch; equals one process on the whole."""
    mesh = pyparallel.init(pp=pp)
    cfg, make = tiny_gpt(3)
    data = gpt_data(cfg)
    ref = reference(make, data)
    model = make()
    pipe = PipelineParallel(model, mesh, schedule="1f1b", num_microbatches=4, reduce_dp_grads=reduce_dp)
    share = BATCH // mesh.dp
    sl = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
    if reduce_dp:
        compare(model, pipe, train_pipe(pipe, data, dp_slice=sl), ref)
        return pyparallel.comm_stats()["by_op_axis"]["all_reduce@dp"]["calls"]
    # Without the built-in reduction the gradients are per replica and must be *summed* (the loss is
    # pre-scaled by the global token count): do it by hand, as ZeRO's reduce-scatter would.
    opt = sgd(list(pipe.parameters()))
    losses = []
    for idx, tgt in data:
        losses.append(pipe.step(idx[sl], tgt[sl]))
        for p in pipe.parameters():
            pyparallel.comm.all_reduce(p.grad, mesh.dp_group, op="sum")
        opt.step()
        opt.zero_grad()
    compare(model, pipe, losses, ref)
    return 0


def test_parity_with_data_parallel():
    assert all(calls > 0 for calls in run(dp_body, 4, True))  # dp=2 x pp=2
    run(dp_body, 4, False)
    assert all(calls > 0 for calls in run(dp_body, 2, True, 1))  # one stage, dp=2


def adam_body(schedule, m, v):
    mesh = pyparallel.init(pp=2)
    cfg, make = tiny_gpt(6, tie_embeddings=False)
    data = gpt_data(cfg)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    ref = reference(make, data, adamw, micro=m)
    model = make()
    pipe = PipelineParallel(model, mesh, schedule=schedule, num_microbatches=m, virtual_stages=v)
    compare(model, pipe, train_pipe(pipe, data, adamw), ref)


def test_adam_matches_one_process_microbatching():
    run(adam_body, 2, "1f1b", 4, 1)
    run(adam_body, 2, "interleaved", 4, 2)


# ---------------------------------------------------------------------------- deadlock-prone traffic


class Wide(nn.Module):
    def __init__(self, width, seed):
        super().__init__()
        self.lin = nn.Linear(width, width)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            self.lin.weight.copy_(torch.randn(width, width, generator=gen) / width**0.5)
            self.lin.bias.copy_(torch.randn(width, generator=gen) * 0.1)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def mse(out, target):
    return ((out - target) ** 2).mean()


class SeqModel(nn.Module):
    def __init__(self, n, width):
        super().__init__()
        self.seq = nn.Sequential(*[Wide(width, s) for s in range(n)])

    def forward(self, x, y):
        return mse(self.seq(x), y)


def deadlock_body(pp):
    """Messages of 1 MB (past any eager buffer: a send completes only once its receive is posted),
    the fewest micro-batches (m = p: the last micro-batch is also the first cool-down one), and
    interleaving (both neighbours send to each other at once)."""
    mesh = pyparallel.init(pp=pp)
    width, rows = 256, 1024 * pp  # a micro-batch of 1024 x 256 fp32 = 1 MB per message
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)) for _ in range(3)]
    ref = reference(lambda: SeqModel(2 * pp, width), data)
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        model = SeqModel(2 * pp, width)
        pipe = PipelineParallel(model.seq, mesh, schedule=schedule, num_microbatches=pp, virtual_stages=v,
                                loss_fn=mse)
        compare(model, pipe, train_pipe(pipe, data), ref)
    return True


@pytest.mark.parametrize("pp", [2, 4])
def test_deadlock_prone_patterns_finish(pp):
    assert run(deadlock_body, pp, pp, deadline_s=120) == [True] * pp
