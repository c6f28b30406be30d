"""Checkpoints reshard: saved at DP2 x TP2 (ZeRO-1), loaded at DP4 (ZeRO-2), at DP2 x PP2 (TP1, ZeRO-2) and
in one process (the plain model and torch.optim.AdamW), the weights and optimizer state are identical
(re-saving from the new layout gives the same tensors, bit for bit), and training continues with the
losses of an uninterrupted run. float64 for the continued losses, for the reason test_combined.py gives
(other layouts sum in other orders; Adam amplifies the last bits of tiny gradients)."""

import pytest
import torch
from dist import run
from models import TINY, batches
from test_combined import BATCH, LR, WD, ce, gpt, reference, train

import pyparallel
from pyparallel import checkpoint
from pyparallel.models.gpt import GPT, gpt_config

SAVE_AT, STEPS = 3, 5


def save_body(root):
    """DP2 x TP2, ZeRO-1: train to SAVE_AT, save, keep going (the uninterrupted run)."""
    mesh = pyparallel.init(dp=2, tp=2)
    pm = pyparallel.parallelize(gpt(), mesh, zero_stage=1, lr=LR, weight_decay=WD)
    first, _ = train(pm, SAVE_AT)
    checkpoint.save(root, pm, pm.optimizer, step=SAVE_AT, extra={"from": "dp2xtp2"})
    rest, _ = train(pm, STEPS, start=SAVE_AT)
    return first + rest


def load_body(root, again, dp, tp, pp, zero, schedule="1f1b"):
    """Load into another layout (from a model with other weights), re-save, continue. Under "zbv" at ZeRO-2
    each rank's buckets are formed per chunk (two per rank): the pieces are per parameter all the same."""
    mesh = pyparallel.init(dp=dp, tp=tp, pp=pp)
    other = GPT(gpt_config("tiny", **TINY), seed=123).to(torch.float64)
    pm = pyparallel.parallelize(other, mesh, zero_stage=zero, num_microbatches=2, schedule=schedule, lr=0.5,
                                weight_decay=WD, loss_fn=None if tp > 1 else ce)
    meta = checkpoint.load(root, pm, pm.optimizer)
    assert meta["step"] == SAVE_AT and meta["extra"] == {"from": "dp2xtp2"} and meta["layout"]["tp"] == 2
    assert pm.optimizer.param_groups[0]["lr"] == LR  # hyper-parameters come back too
    checkpoint.save(again, pm, pm.optimizer, step=SAVE_AT)
    return train(pm, STEPS, start=SAVE_AT)[0]


def same_checkpoints(a, b):
    ta, tb = checkpoint.read_tensors(a), checkpoint.read_tensors(b)
    assert ta.keys() == tb.keys(), sorted(set(ta) ^ set(tb))
    assert any(k.endswith("/exp_avg_sq") for k in ta) and any(k.endswith("/step") for k in ta)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def test_reshard_round_trips(tmp_path):
    root = str(tmp_path / "dp2tp2")
    uninterrupted = run(save_body, 4, root)[0]
    ref_losses, ref_params, _ = reference(gpt)
    torch.testing.assert_close(torch.tensor(uninterrupted, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64))
    want = torch.tensor(uninterrupted[SAVE_AT:], dtype=torch.float64)
    for name, layout in [("dp4", (4, 1, 1, 2)), ("dp2pp2", (2, 1, 2, 2)), ("dp2pp2zbv", (2, 1, 2, 2, "zbv"))]:
        again = str(tmp_path / name)
        losses = run(load_body, 4, root, again, *layout)[0]
        same_checkpoints(root, again)
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), want)

    # One process, no pyparallel wrapper at all: the plain model and torch's AdamW.
    model = GPT(gpt_config("tiny", **TINY), seed=9).to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=WD)
    checkpoint.load(root, model, opt)
    assert opt.param_groups[0]["lr"] == LR
    checkpoint.save(str(tmp_path / "single"), model, opt, step=SAVE_AT)
    same_checkpoints(root, str(tmp_path / "single"))
    losses = []
    for idx, tgt in batches(STEPS, BATCH)[SAVE_AT:]:
        loss = ce(model(idx), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), want)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[n], msg=n)


def hf_save_body(root):
    """Hugging Face GPT-2 (Conv1D weights: TP shards are transposed boxes) at DP2 x TP2, ZeRO-1."""
    from test_combined import hf

    mesh = pyparallel.init(dp=2, tp=2)
    pm = pyparallel.parallelize(hf("gpt2", torch.float32), mesh, zero_stage=1, lr=LR, weight_decay=WD)
    train(pm, 2)
    checkpoint.save(root, pm, pm.optimizer, step=2)
    return pm.full_state_dict()


def test_export_from_a_tensor_parallel_layout_loads_in_transformers(tmp_path):
    import transformers
    from test_combined import hf

    root = str(tmp_path / "ckpt")
    full = run(hf_save_body, 4, root)[0]
    out = tmp_path / "hf"
    out.mkdir()
    keys = checkpoint.export_consolidated(root, str(out / "model.safetensors"))
    hf("gpt2", torch.float32).config.save_pretrained(str(out))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    assert set(keys) == set(full) and "transformer.h.0.attn.c_attn.weight" in keys
    state = loaded.state_dict()
    for name, value in full.items():
        assert torch.equal(state[name], value), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # the tie is kept


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def standalone_body(root):
    """The strategies on their own -- pyparallel.zero.setup (stages 2 and 3), tensor_parallel.parallelize
    with torch's AdamW, PipelineParallel with torch's AdamW -- save pieces whose global tensors equal what
    each strategy itself gathers, and load back into a fresh copy of themselves with identical state."""
    from pyparallel import zero
    from pyparallel.pipeline_parallel import PipelineParallel
    from pyparallel.tensor_parallel import full_parameters
    from pyparallel.tensor_parallel import parallelize as tp_parallelize

    data = batches(2, BATCH)
    mesh = pyparallel.init()
    sl = slice(mesh.rank * 2, mesh.rank * 2 + 2)
    for stage in (2, 3):
        path = f"{root}/zero{stage}"
        model, opt = zero.setup(gpt(torch.float32), mesh, stage=stage, lr=LR, weight_decay=WD)
        for idx, tgt in data:
            model(idx[sl], tgt[sl]).backward()
            opt.step()
            opt.zero_grad()
        checkpoint.save(path, model, opt, step=2, mesh=mesh)
        saved = checkpoint.read_tensors(path, "model/")
        _same_state({f"model/{k}": v for k, v in model.full_state_dict().items()}, saved)
        fresh, fresh_opt = zero.setup(GPT(gpt_config("tiny", **TINY), seed=5), mesh, stage=stage, lr=0.5)
        checkpoint.load(path, fresh, fresh_opt)
        assert all(torch.equal(fresh.engine.master_slice(g), model.engine.master_slice(g))
                   for g in range(len(model.engine.layouts)))
        _same_state(fresh_opt.inner.state[fresh_opt.inner.param_groups[0]["params"][0]],
                    opt.inner.state[opt.inner.param_groups[0]["params"][0]])
        assert fresh_opt.param_groups[0]["lr"] == LR

    mesh = pyparallel.init(tp=4)
    model = tp_parallelize(gpt(torch.float32), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for idx, tgt in data:
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(f"{root}/tp4", model, opt, step=2, mesh=mesh)
    saved = checkpoint.read_tensors(f"{root}/tp4", "model/")
    _same_state({f"model/{k}": v for k, v in full_parameters(model).items()}, saved)
    fresh = tp_parallelize(GPT(gpt_config("tiny", **TINY), seed=5), mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    checkpoint.load(f"{root}/tp4", fresh, fresh_opt)
    for (n, p), q in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n
        _same_state(fresh_opt.state[p], opt.state[q])

    mesh = pyparallel.init(pp=2)
    model = gpt(torch.float32)
    names = {id(p): n for n, p in model.named_parameters()}
    pipe = PipelineParallel(model, mesh, num_microbatches=2)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=LR, weight_decay=WD)
    for idx, tgt in data:
        pipe.step(idx[pipe_rows(mesh)], tgt[pipe_rows(mesh)])
        opt.step()
        opt.zero_grad()
    checkpoint.save(f"{root}/dp2pp2", pipe, opt, step=2)
    saved = checkpoint.read_tensors(f"{root}/dp2pp2", "model/")
    assert set(saved) == {f"model/{n}" for n in names.values()}
    for p in pipe.parameters():
        assert torch.equal(saved[f"model/{names[id(p)]}"], p), names[id(p)]
    return sorted(checkpoint.read_tensors(f"{root}/dp2pp2", "optim/"))


def pipe_rows(mesh):
    share = BATCH // mesh.dp
    return slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)


def test_each_strategy_on_its_own_saves_and_loads_pieces(tmp_path):
    optim_names = run(standalone_body, 4, str(tmp_path))[0]
    assert "optim/embed.wte.weight/exp_avg" in optim_names
    # Every one of them loads into the plain model and torch's AdamW in one process, and re-saving there
    # gives back the same global tensors.
    for name in ("zero2", "zero3", "tp4", "dp2pp2"):
        model = GPT(gpt_config("tiny", **TINY), seed=9)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        checkpoint.load(str(tmp_path / name), model, opt)
        checkpoint.save(str(tmp_path / f"{name}-single"), model, opt, step=2)
        same_checkpoints(str(tmp_path / name), str(tmp_path / f"{name}-single"))


def pipeline_hf_body(root, kind):
    """PipelineParallel on a Hugging Face model names its checkpoint tensors by the model's own names:
    full_state_dict, a plain-model load and an export that from_pretrained reads with no missing keys."""
    from models import hf_model

    from pyparallel.pipeline_parallel import PipelineParallel

    mesh = pyparallel.init(pp=2)
    pipe = PipelineParallel(hf_model(kind), mesh, num_microbatches=2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    for idx, tgt in batches(2, BATCH):
        pipe.step(idx, tgt)
        opt.step()
        opt.zero_grad()
    full = pipe.full_state_dict()
    checkpoint.save(root, pipe, opt, step=2, mesh=mesh)
    plain = hf_model(kind, seed=7)
    checkpoint.load(root, plain)  # by the plain model's own names
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), full[name]), name
    return sorted(full)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_pipeline_checkpoints_use_the_model_names(tmp_path, kind):
    import transformers
    from models import hf_model

    root = str(tmp_path / "ckpt")
    names = run(pipeline_hf_body, 2, root, kind)[0]
    model = hf_model(kind)
    assert names == sorted(n for n, _ in model.named_parameters())
    out = tmp_path / "hf"
    out.mkdir()
    checkpoint.export_consolidated(root, str(out / "model.safetensors"))
    model.config.save_pretrained(str(out))
    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.AutoModelForCausalLM
    loaded, info = cls.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
