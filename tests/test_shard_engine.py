"""The one sharded engine in every composition: ``pyparallel.parallelize`` at ZeRO stages 0-3 on dp x tp x pp
layouts (ZeRO-3 included), with two parameter groups, equals one process; the model-state bytes match the
formulas; ZeRO-3 under a pipeline moves its weights once per step; parameter groups, model mismatches and
non-finite gradients fail as documented.

float64 for the TP layouts, as in test_combined.py (TP reorders sums; Adam turns the last bits of a tiny
gradient into a visible difference): losses every step and every parameter after 5 AdamW steps.
"""

import pytest
import torch
import torch.nn.functional as F
from dist import run
from models import TINY, batches, hf_model

import pyparallel
from pyparallel import memory, zero
from pyparallel.models.gpt import GPT, gpt_config

STEPS, BATCH = 5, 8
LR, WD = 1e-2, 0.1


def ce(outputs, targets):
    return F.cross_entropy(outputs.flatten(0, -2), targets.flatten())


def gpt(dtype=torch.float64):
    return GPT(gpt_config("tiny", **TINY), seed=0).to(dtype)


def llama(dtype=torch.float64):
    return hf_model("llama", tie_word_embeddings=True).to(dtype)


MODELS = {"gpt": gpt, "llama": llama}


def groups_of(model):
    """nanoGPT's recipe, and a second learning rate: decay on matrices, none (and 2x lr) on the rest."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 2 * LR}]


def logits_of(model, idx):
    out = model(idx)
    return out if torch.is_tensor(out) else out.logits


def reference(make):
    model = make()
    opt = torch.optim.AdamW(groups_of(model), lr=LR, weight_decay=WD)
    losses = []
    for idx, tgt in batches(STEPS, BATCH):
        loss = ce(logits_of(model, idx), tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(pm, steps=STEPS, start=0):
    sl = pm.batch_slice(BATCH)
    return [pm.step(idx[sl], tgt[sl]) for idx, tgt in batches(steps, BATCH)[start:]]


def compare(pm, ref, losses):
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64))
    full = pm.full_state_dict()
    assert full.keys() == ref_params.keys(), sorted(set(full) ^ set(ref_params))
    for name, p in full.items():
        torch.testing.assert_close(p, ref_params[name], msg=lambda m, name=name: f"{name}: {m}")


def _expected_states(eng, stage: int, elem: int) -> int:
    """The per-rank model states of one stage/TP shard in the model's own dtype (no separate master): the
    fp32/fp64 analogue of the ZeRO paper's figure 1 (weights + gradients + Adam's two moments). Adam's
    moments cover the elements this rank updates (its runs): its slice, or for a weight tied across
    pipeline stages its stage's part of the slice."""
    local, s = eng.space.padded_numel if stage else sum(lay.padded for lay in eng.layouts), eng.space.numel
    owned = sum(r.hi - r.lo for r in eng.runs)
    frozen = sum(p.numel() * p.element_size() for _, p in eng.frozen)
    per_stage = {0: 2 * elem * local, 1: 2 * elem * local, 2: elem * local + elem * s, 3: 2 * elem * s}
    return per_stage[stage] + 2 * elem * owned + frozen + 4 * len(eng.runs)  # + one fp32 step count per tensor


def layouts_body(kind, layouts):
    """Each layout (dp, tp, pp, micro-batches) at every stage. One micro-batch without a pipeline takes the
    overlapped path (buckets reduce-scattered during backward); more accumulate and reduce at the step."""
    ref = reference(MODELS[kind])
    for dp, tp, pp, m in layouts:
        for stage in (0, 1, 2, 3):
            mesh = pyparallel.init(dp=dp, tp=tp, pp=pp)
            model = MODELS[kind]()
            pm = pyparallel.parallelize(model, mesh, zero_stage=stage, num_microbatches=m, lr=LR, weight_decay=WD,
                                        param_groups=groups_of(model), loss_fn=None if tp > 1 else ce)
            assert [g["lr"] for g in pm.optimizer.param_groups] == [LR, 2 * LR]
            assert [g["weight_decay"] for g in pm.optimizer.param_groups] == [WD, 0.0]
            losses = train(pm)
            compare(pm, ref, losses)
            rep = memory.model_state_bytes(pm)
            assert rep["master"] == 0 and rep["model_states"] == _expected_states(pm.engine, stage, 8), \
                (kind, dp, tp, pp, stage, rep)
    return True


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_every_stage_and_layout_equals_one_process(kind):
    run(layouts_body, 2, kind, [(2, 1, 1, 2)])
    run(layouts_body, 4, kind, [(2, 2, 1, 1), (2, 2, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2)])


def zero3_pp_traffic_body():
    mesh = pyparallel.init(dp=2, pp=2)
    pm = pyparallel.parallelize(gpt(torch.float32), mesh, zero_stage=3, num_microbatches=8, lr=LR, loss_fn=ce)
    sl = pm.batch_slice(16)
    data = batches(2, 16)
    pm.step(*[t[sl] for t in data[0]])
    pyparallel.reset_comm_stats()
    pm.step(*[t[sl] for t in data[1]])
    stats = pyparallel.comm_stats()["by_op_axis"]
    padded = sum(lay.padded for lay in pm.engine.layouts)  # this stage's elements, padded for dp
    # One gather of the stage's weights and one reduce-scatter of its gradients per step, for 8 micro-batches.
    assert stats["all_gather@dp"]["payload_bytes"] == 4 * padded, stats
    assert stats["reduce_scatter@dp"]["payload_bytes"] == 4 * padded, stats
    assert stats["all_gather@dp"]["calls"] == len(pm.engine.layouts)
    rep = memory.model_state_bytes(pm)
    # 16Ψ/N at rest in fp32, but Adam's moments only over the elements this rank updates (the tied
    # embedding's slice is split between the two stages that hold it).
    owned = sum(r.hi - r.lo for r in pm.engine.runs)
    assert owned < pm.engine.space.numel
    assert rep["model_states"] == 8 * pm.engine.space.numel + 8 * owned + 4 * len(pm.engine.runs)
    return padded


def test_zero3_under_a_pipeline_gathers_once_per_step():
    per_rank = run(zero3_pp_traffic_body, 4)
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]  # the dp pair of each stage agrees


def reshard_body(tmp):
    """ZeRO-3 on dp2 x pp2 -> save -> ZeRO-1 on dp2 x tp2 and zero.setup stage 3 on dp4: each continues with
    the losses of an uninterrupted run."""
    from pyparallel import checkpoint

    ref = reference(gpt)
    mesh = pyparallel.init(dp=2, pp=2)
    model = gpt()
    pm = pyparallel.parallelize(model, mesh, zero_stage=3, num_microbatches=2, lr=LR, weight_decay=WD,
                                param_groups=groups_of(model), loss_fn=ce)
    first = train(pm, steps=3)
    checkpoint.save(tmp, pm, pm.optimizer, step=3)
    mesh2 = pyparallel.init(dp=2, tp=2)
    model2 = gpt()
    pm2 = pyparallel.parallelize(model2, mesh2, zero_stage=1, num_microbatches=2, lr=0.5, weight_decay=WD,
                                 param_groups=groups_of(model2))
    checkpoint.load(tmp, pm2, pm2.optimizer)
    assert [g["lr"] for g in pm2.optimizer.param_groups] == [LR, 2 * LR]  # hyper-parameters came back
    compare(pm2, ref, first + train(pm2, start=3))
    mesh3 = pyparallel.init()
    model3 = gpt()
    zm, zopt = zero.setup(model3, mesh3, stage=3, lr=0.5, weight_decay=WD, param_groups=groups_of(model3))
    checkpoint.load(tmp, zm, zopt)
    losses = list(first)
    for idx, tgt in batches(STEPS, BATCH)[3:]:
        share = BATCH // mesh3.dp
        rows = slice(mesh3.dp_rank * share, (mesh3.dp_rank + 1) * share)
        loss = ce(zm(idx[rows]), tgt[rows])
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        from pyparallel import comm

        comm.all_reduce(total, mesh3.dp_group, op="avg")
        losses.append(float(total))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]))
    full = zm.full_state_dict(torch.float64)
    for name, p in ref[1].items():
        torch.testing.assert_close(full[name], p, msg=lambda m, name=name: f"{name}: {m}")
    return True


def test_checkpoint_moves_between_zero3_and_other_layouts(tmp_path):
    run(reshard_body, 4, str(tmp_path / "ckpt"))


def zero_setup_then_parallelize_body(tmp):
    """zero.setup (fp64, two parameter groups, stages 1 and 2) for 3 steps -> save -> parallelize on dp2 x tp2
    ZeRO-2 loads it (the fp64 optimizer state in the master's dtype) and continues as if uninterrupted."""
    from pyparallel import checkpoint, comm

    ref = reference(gpt)
    for stage in (1, 2):
        mesh = pyparallel.init(dp=4)
        model = gpt()
        zm, zopt = zero.setup(model, mesh, stage=stage, lr=LR, weight_decay=WD, param_groups=groups_of(model),
                              bucket_cap_mb=0.01)
        losses = []
        share = BATCH // mesh.dp
        rows = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)
        for idx, tgt in batches(3, BATCH):
            loss = ce(zm(idx[rows]), tgt[rows])
            loss.backward()
            zopt.step()
            zopt.zero_grad()
            total = torch.tensor([loss.item()], dtype=torch.float64)
            comm.all_reduce(total, mesh.dp_group, op="avg")
            losses.append(float(total))
        path = f"{tmp}-{stage}"
        checkpoint.save(path, zm, zopt, step=3)
        mesh2 = pyparallel.init(dp=2, tp=2)
        model2 = gpt()
        pm = pyparallel.parallelize(model2, mesh2, zero_stage=2, lr=0.5, weight_decay=WD,
                                    param_groups=groups_of(model2))
        checkpoint.load(path, pm, pm.optimizer)
        state = next(iter(pm.optimizer.state.values()))
        assert state["exp_avg"].dtype == torch.float64
        compare(pm, ref, losses + train(pm, start=3))
    return True


def test_zero_setup_checkpoint_continues_under_parallelize(tmp_path):
    run(zero_setup_then_parallelize_body, 4, str(tmp_path / "ckpt"))


def fp16_scaler_body(tmp):
    """zero.setup under fp16: an overflow halves the scale; save/load brings back the scale and counts."""
    from pyparallel import checkpoint

    mesh = pyparallel.init()
    model, opt = zero.setup(gpt(torch.float32), mesh, stage=2, lr=LR, param_dtype=torch.float16)
    scaler = opt.scaler
    idx, tgt = batches(1, BATCH)[0]
    loss = model(idx[:2], tgt[:2])
    (loss * float("inf")).backward()  # an overflow on every rank
    opt.step()
    assert opt.last_step_skipped and scaler.skipped_steps == 1
    opt.zero_grad()
    model(idx[:2], tgt[:2]).backward()
    opt.step()
    saved = scaler.state_dict()
    checkpoint.save(tmp, model, opt, step=2)
    model2, opt2 = zero.setup(gpt(torch.float32), mesh, stage=1, lr=LR, param_dtype=torch.float16)
    assert opt2.scaler.state_dict() != saved
    checkpoint.load(tmp, model2, opt2)
    assert opt2.scaler.state_dict() == saved
    return saved["scale"]


def test_fp16_loss_scaler_survives_a_checkpoint(tmp_path):
    scales = run(fp16_scaler_body, 2, str(tmp_path / "ckpt"))
    assert scales[0] == scales[1] and scales[0] < 2.0 ** 16


def mismatch_body(degrees):
    from pyparallel import comm

    mesh = pyparallel.init(**degrees)
    cfg = dict(TINY)
    if mesh.rank == 1:
        cfg["n_embd"] = 64  # this rank built another model
    with pytest.raises(ValueError, match="hold different models") as info:
        pyparallel.parallelize(GPT(gpt_config("tiny", **cfg), seed=0), mesh, lr=LR, num_microbatches=2)
    assert comm.comm_stats()["total"]["calls"] == 1, comm.comm_stats()["by_op_axis"]  # the check alone
    return str(info.value)


@pytest.mark.parametrize("degrees", [dict(tp=2), dict(pp=2)])
def test_model_mismatch_is_a_value_error_on_every_rank(degrees):
    messages = run(mismatch_body, 2, degrees)
    assert messages[0] == messages[1] and "rank 1" in messages[0]


def batch_mismatch_body():
    mesh = pyparallel.init(tp=2)
    pm = pyparallel.parallelize(gpt(torch.float32), mesh, lr=LR)
    idx, tgt = batches(1, BATCH)[0]
    rows = 3 if mesh.tp_rank == 1 else 2  # this rank was handed another batch size
    with pytest.raises(ValueError, match="must step the same batch") as info:
        pm.step(idx[:rows], tgt[:rows])
    return str(info.value)


def test_tp_ranks_with_different_batches_get_a_value_error_not_an_abort():
    messages = run(batch_mismatch_body, 2)
    assert messages[0] == messages[1] and "(3, 12)" in messages[0] and "(2, 12)" in messages[0]


def groups_errors_body():
    from pyparallel import comm

    mesh = pyparallel.init()
    cases = [
        (lambda ps: [{"params": ps[:2]}, {"params": ps[1:3]}], "at most one group"),
        (lambda ps: [{"params": [torch.nn.Parameter(torch.zeros(3))]}], "not a parameter of the model"),
        (lambda ps: [{"params": ps, "no_such_option": 1}], "no_such_option"),
        (lambda ps: {"params": ps}, "list of dicts"),
    ]
    wrappers = [lambda m, g: zero.setup(m, mesh, stage=1, lr=LR, param_groups=g),
                lambda m, g: pyparallel.parallelize(m, mesh, lr=LR, param_groups=g)]
    for make_groups, text in cases:
        for wrap in wrappers:
            model = gpt(torch.float32)
            with pytest.raises(ValueError, match=text):
                wrap(model, make_groups(list(model.parameters())))
    model = gpt(torch.float32)
    with pytest.raises(ValueError, match="param_groups="):
        zero.setup(model, mesh, optimizer=torch.optim.AdamW(model.parameters()))
    assert comm.comm_stats()["total"]["calls"] == 0  # all before the first collective
    return True


def test_parameter_group_errors():
    run(groups_errors_body, 2)


def scheduler_body():
    mesh = pyparallel.init()
    model = gpt(torch.float32)
    zm, opt = zero.setup(model, mesh, stage=2, lr=LR, weight_decay=WD, param_groups=groups_of(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.5 ** s, lambda s: 1.0])
    idx, tgt = batches(1, BATCH)[0]
    for _ in range(2):
        zm(idx[:2], tgt[:2]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return [g["lr"] for g in opt.param_groups]


def test_lr_schedulers_see_one_group_per_user_group():
    lrs = run(scheduler_body, 2)
    assert lrs[0] == lrs[1] == pytest.approx([LR * 0.25, 2 * LR])


def nonfinite_body():
    mesh = pyparallel.init()
    idx, tgt = batches(1, BATCH)[0]
    out = {}
    for mode in ("raise", "skip"):
        model, opt = zero.setup(gpt(torch.float32), mesh, stage=1, lr=LR, clip_grad_norm=1.0, nonfinite=mode)
        before = {k: v.clone() for k, v in model.full_state_dict().items()}
        loss = model(idx[:2], tgt[:2])
        # One rank's gradient goes NaN: every rank must see it through the all-reduced norm.
        (loss * (float("nan") if mesh.dp_rank == 1 else 1.0)).backward()
        if mode == "raise":
            with pytest.raises(zero.NonFiniteGradientError, match="step 0: the gradient of parameter group 0"):
                opt.step()
        else:
            opt.step()
            assert opt.last_step_skipped
        after = model.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was updated
        out[mode] = True
    return out


def test_nonfinite_gradients_raise_or_skip_on_every_rank():
    assert run(nonfinite_body, 2) == [{"raise": True, "skip": True}] * 2
