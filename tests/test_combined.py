"""pyparallel.parallelize: DP x TP x PP (+ ZeRO 1/2) equals the unparallelised model in one process.

Every layout trains the same model on the same global batch for 5 AdamW steps and is compared with one
process on the whole batch: the loss of every step and every parameter afterwards (gathered back to
full size), at default tolerance.

Why float64 for these comparisons: tensor parallelism sums partial products in another order (and
fuses GeLU into the row matmul), which changes the last bits of a few gradients. Adam's update
g / (sqrt(v) + eps) divides each element by its own gradient scale, so an element whose gradient is
tiny turns those last bits into a visible difference: the tiny GPT here has one element of
``blocks.0.mlp.fc_in.weight`` whose first gradient is 5e-8, and after 5 fp32 steps it differs by 1.3e-5
from the one-process run -- with ``tensor_parallel.parallelize`` and ``torch.optim.AdamW`` alone, without
any of this module's code. In float64 the rounding is 1e-16 and the comparison is exact in substance.
``test_fp32_data_and_pipeline_parity`` checks the fp32 path itself where no reordering is involved.
"""

import pytest
import torch
import torch.nn.functional as F
from dist import run
from models import TINY, batches

import pyparallel
from pyparallel.models.gpt import GPT, gpt_config

STEPS, BATCH = 5, 8
LR, WD = 1e-2, 0.1


def ce(outputs, targets):
    """Token cross-entropy in the outputs' dtype (the GPT's own loss upcasts to fp32, not to fp64)."""
    return F.cross_entropy(outputs.flatten(0, -2), targets.flatten())


def gpt(dtype=torch.float64, **cfg):
    return GPT(gpt_config("tiny", **{**TINY, **cfg}), seed=0).to(dtype)


def hf(kind, dtype=torch.float64):
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                       max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                       tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(cfg).to(dtype)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def logits_of(model, idx):
    out = model(idx)
    return out if torch.is_tensor(out) else out.logits


def reference(make, clip=None, steps=STEPS):
    """One process, whole batch: losses, final parameters and the clip norms."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for idx, tgt in batches(steps, BATCH):
        loss = ce(logits_of(model, idx), tgt)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def train(pm, steps=STEPS, start=0):
    sl = pm.batch_slice(BATCH)
    losses, norms = [], []
    for idx, tgt in batches(steps, BATCH)[start:]:
        losses.append(pm.step(idx[sl], tgt[sl]))
        norms.append(pm.last_grad_norm)
    return losses, norms


def compare(pm, ref, losses, norms=None):
    ref_losses, ref_params, ref_norms = ref
    dtype = next(iter(ref_params.values())).dtype
    torch.testing.assert_close(torch.tensor(losses, dtype=dtype), torch.tensor(ref_losses, dtype=dtype))
    if ref_norms:
        torch.testing.assert_close(torch.tensor(norms, dtype=dtype), torch.tensor(ref_norms, dtype=dtype))
    full = pm.full_state_dict()
    assert full.keys() == ref_params.keys(), sorted(set(full) ^ set(ref_params))
    for name, p in full.items():
        torch.testing.assert_close(p, ref_params[name], msg=lambda m, name=name: f"{name}: {m}")


def layouts_body(configs):
    """Each config: (dp, tp, pp, zero_stage, micro-batches, schedule, virtual stages, clip)."""
    refs = {}
    out = []
    for dp, tp, pp, zero, m, schedule, v, clip in configs:
        if clip not in refs:
            refs[clip] = reference(gpt, clip)
        mesh = pyparallel.init(dp=dp, tp=tp, pp=pp)
        pm = pyparallel.parallelize(gpt(), mesh, zero_stage=zero, num_microbatches=m, schedule=schedule,
                                    virtual_stages=v, clip_grad_norm=clip, lr=LR, weight_decay=WD,
                                    loss_fn=None if tp > 1 else ce)
        losses, norms = train(pm)
        compare(pm, refs[clip], losses, norms)
        out.append(sum(p.numel() for p in pm.parameters()))
    return out


def test_layouts_equal_one_process():
    configs = [
        (2, 2, 1, 0, 1, "1f1b", 1, None),  # DP2 x TP2
        (2, 1, 2, 0, 2, "1f1b", 1, None),  # DP2 x PP2 (wte / lm_head tied across the stages)
        (1, 2, 2, 0, 2, "gpipe", 1, None),  # TP2 x PP2
        (2, 2, 1, 2, 2, "1f1b", 1, None),  # DP2 ZeRO-2 x TP2, two micro-batches accumulated in the shard
        (2, 1, 2, 1, 2, "interleaved", 2, 0.05),  # DP2 ZeRO-1 x PP2 interleaved, clipped by the global norm
        (2, 1, 2, 2, 4, "1f1b", 1, 0.05),  # DP2 ZeRO-2 x PP2, tied weight summed on its shard, clipped
    ]
    held = run(layouts_body, 4, configs)
    total = sum(p.numel() for p in gpt().parameters())
    assert held[0][0] < total and held[0][1] < total  # each rank really holds a part


def test_zero_bubble_schedules_inside_parallelize():
    """ZB-H1 and ZBV (split backward, deferred W) under TP x PP and DP x PP with ZeRO equal one process."""
    configs = [
        (1, 2, 2, 0, 2, "zb-h1", 1, None),  # TP2 x PP2
        (2, 1, 2, 3, 4, "zbv", 2, 0.05),  # DP2 ZeRO-3 x PP2, the V (first and last chunk on rank 0), clipped
        (2, 1, 2, 1, 2, "zb-h1", 1, None),  # DP2 ZeRO-1 x PP2, the tied weight across the stages
    ]
    run(layouts_body, 4, configs)


def _record_launches(reducer):
    """A list that gets the bytes of each reduce-scatter ``reducer`` launches from now on."""
    sizes, fn = [], reducer.launch

    def launch(full, target, *args, **kwargs):
        sizes.append(full.numel() * full.element_size())
        return fn(full, target, *args, **kwargs)

    reducer.launch = launch
    return sizes


def zero2_rounds_body(configs):
    """Each config: (dp, pp, schedule, virtual stages, frozen embedding). ZeRO-2 under a pipeline, where a
    round is one micro-batch's backward of one chunk, or under a zero-bubble schedule one whole W (which
    accumulates weight gradients outside autograd, split.py's direct W, and over several autograd calls):
    5 clipped AdamW steps against one process (the norm before clipping would double if a gradient were
    reduced twice), and per step each flat group reduce-scattered exactly once per micro-batch: one pass
    over the stage's gradient per micro-batch, in reduce-scatters and in bytes, also with two chunks per
    rank (a round reduces only its own chunk's buckets, never the other chunk's as zeros)."""
    out = []
    m = 4
    for dp, pp, schedule, v, frozen in configs:
        def make(frozen=frozen):
            model = gpt(tie_embeddings=not frozen)
            if frozen:  # chunk 0 is the embedding alone: no gradient crosses boundary 0
                model.embed.requires_grad_(False)
            return model

        ref = reference(make, clip=0.05)
        mesh = pyparallel.init(dp=dp, pp=pp)
        pm = pyparallel.parallelize(make(), mesh, zero_stage=2, num_microbatches=m, schedule=schedule,
                                    virtual_stages=v, clip_grad_norm=0.05, lr=LR, weight_decay=WD, loss_fn=ce,
                                    bucket_cap_mb=1e-3)
        engine = pm.engine
        sizes = _record_launches(engine.reducer)
        losses, norms = train(pm)
        compare(pm, ref, losses, norms)
        layouts = engine.layouts
        stage_grad_bytes = sum(lay.padded for lay in layouts) * 8  # float64
        assert len(sizes) == STEPS * m * len(layouts), (len(sizes), len(layouts))
        assert sum(sizes) == STEPS * m * stage_grad_bytes, (sum(sizes), stage_grad_bytes)
        chunks = pm.pipe.chunks
        trained = sum(any(q.requires_grad for q in ch.parameters()) for ch in chunks.values())
        if len(chunks) > 1:  # no bucket mixes chunks: each holds the parameters of one set of local chunks
            for lay in layouts:
                holders = {frozenset(c for c, ch in chunks.items() if any(q is p for q in ch.parameters()))
                           for p in lay.params}
                assert len(holders) == 1, lay.names
            assert sorted(g for order in engine.rounds.values() for g in order) == list(range(len(layouts)))
        else:
            assert engine.rounds is None
        out.append((trained, len(layouts), sum(sizes) // STEPS))
    return out


def test_zero2_under_zero_bubble_schedules():
    """ZeRO-2 reduce-scatters each bucket as its W completes it, once per (chunk, micro-batch)."""
    configs = [(1, 2, "zb-h1", 1, False), (1, 2, "zbv", 2, False), (1, 2, "zbv", 2, True)]
    held = run(zero2_rounds_body, 2, configs)
    assert held[0][2][0] == 1 and held[1][2][0] == 2  # frozen: rank 0 trains only the head's chunk
    assert all(n > 1 for rank in held for _, n, _ in rank)  # several buckets: each one's round is checked


def test_zero2_zbv_over_data_parallel():
    """DP2 x PP2 under ZBV: early W's run in an order that differs between the replicas; each round's
    reduce-scatters still go out at its W's place in the list, so both replicas issue the same ones."""
    held = run(zero2_rounds_body, 4, [(2, 2, "zbv", 2, False)])
    assert all(rank[0][0] == 2 for rank in held)  # two trained chunks per rank, one pass of traffic


def test_zero2_interleaved_over_data_parallel():
    """DP2 x PP2 interleaved with two chunks per rank (the tied embedding and head on different stages):
    one round per chunk's backward, reducing only that chunk's buckets."""
    held = run(zero2_rounds_body, 4, [(2, 2, "interleaved", 2, False)])
    assert all(rank[0][0] == 2 for rank in held)


def tp_pp_clip_body():
    """TP2 x PP2 with clipping: the norm counts replicated LayerNorms once and the tied weight once."""
    ref = reference(gpt, clip=0.05)
    mesh = pyparallel.init(tp=2, pp=2)
    pm = pyparallel.parallelize(gpt(), mesh, zero_stage=1, num_microbatches=2, clip_grad_norm=0.05, lr=LR,
                                weight_decay=WD)
    losses, norms = train(pm)
    compare(pm, ref, losses, norms)
    assert all(n > 0.05 for n in norms)  # it really clipped


def test_clipping_over_all_three_axes():
    run(tp_pp_clip_body, 4)


def tied_split_body():
    """DP2 x PP2, every ZeRO stage, 1F1B, clipped: the tied wte / lm_head is shared out between its two
    stages -- each keeps AdamW state for half of its slice -- and training equals one process."""
    ref = reference(gpt, 0.05)
    held = []
    for zero in (0, 1, 2, 3):
        mesh = pyparallel.init(dp=2, pp=2)
        pm = pyparallel.parallelize(gpt(), mesh, zero_stage=zero, num_microbatches=2, clip_grad_norm=0.05, lr=LR,
                                    weight_decay=WD, loss_fn=ce)
        losses, norms = train(pm)
        compare(pm, ref, losses, norms)
        eng = pm.engine
        (g, tie), = eng.tie_groups
        lay = eng.layouts[g]
        assert tie.size == 2 and lay.split == 2
        state = [prm for run, prm in zip(eng.runs, eng.updater.params) if run.g == g]
        exp_avg = sum(eng.optimizer.state[prm]["exp_avg"].numel() for prm in state)
        held.append((exp_avg, lay.shard_numel // 2, lay.numel, lay.padded))
    return held


def test_tied_weight_is_shared_out_between_its_stages():
    for held in run(tied_split_body, 4):
        for zero, (exp_avg, half_slice, numel, padded) in enumerate(held):
            assert exp_avg == half_slice  # half of this rank's slice: 1/2 (stage 0) or 1/4 (ZeRO) of the matrix
            holders = 2 if zero == 0 else 4  # the ranks holding distinct parts (stage 0: DP replicas repeat)
            assert exp_avg * holders == padded and numel <= padded < numel + holders


def fp32_body():
    """fp32 end to end where no summation order changes: DP2 ZeRO-1 x PP2 and stage 0."""
    ref = reference(lambda: gpt(torch.float32))
    for stage in (0, 1):
        mesh = pyparallel.init(dp=2, pp=2)
        pm = pyparallel.parallelize(gpt(torch.float32), mesh, zero_stage=stage, num_microbatches=2, lr=LR,
                                    weight_decay=WD, loss_fn=ce)
        compare(pm, ref, train(pm)[0])


def test_fp32_data_and_pipeline_parity():
    run(fp32_body, 4)


def hf_body(kind, dp, tp, pp, zero):
    ref = reference(lambda: hf(kind))
    mesh = pyparallel.init(dp=dp, tp=tp, pp=pp)
    pm = pyparallel.parallelize(hf(kind), mesh, zero_stage=zero, num_microbatches=2, lr=LR, weight_decay=WD,
                                loss_fn=None if tp > 1 else ce)
    compare(pm, ref, train(pm)[0])


@pytest.mark.parametrize("kind,layout", [("llama", (1, 2, 2, 1)), ("gpt2", (2, 2, 1, 2))])
def test_hugging_face_models(kind, layout):
    run(hf_body, 4, kind, *layout)


def precision_body():
    """bf16 compute with fp32 master and fp32 reduction (DP2 ZeRO-2 x TP2), and fp16 with dynamic loss
    scaling (DP2 ZeRO-1 x PP2) whose overflow decisions agree on every rank."""
    ref_losses = reference(lambda: gpt(torch.float32))[0]
    mesh = pyparallel.init(dp=2, tp=2)
    pm = pyparallel.parallelize(gpt(torch.float32), mesh, zero_stage=2, num_microbatches=2, lr=LR, weight_decay=WD,
                                param_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in pm.parameters())
    assert pm.engine.master.dtype == torch.float32 and pm.engine.grad_shard.dtype == torch.float32
    losses = train(pm)[0]
    bf16 = torch.tensor(losses, dtype=torch.bfloat16)
    torch.testing.assert_close(bf16, torch.tensor(ref_losses, dtype=torch.bfloat16))  # bf16 tolerance
    assert {t.dtype for p, t in pm.checkpoint_pieces() if p.name.startswith("model/")} == {torch.float32}

    mesh = pyparallel.init(dp=2, pp=2)
    scaler = pyparallel.amp.DynamicLossScaler(init_scale=2.0**30, backoff_factor=2.0**-8)
    pm = pyparallel.parallelize(gpt(torch.float32), mesh, zero_stage=1, num_microbatches=2, lr=LR,
                                weight_decay=WD, param_dtype=torch.float16, loss_scaler=scaler, clip_grad_norm=1.0)
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    sl = pm.batch_slice(BATCH)
    idx, tgt = batches(1, BATCH)[0]
    pm.step(idx[sl], tgt[sl])  # 2^30 overflows fp16 gradients: skipped everywhere, weights untouched
    assert scaler.skipped_steps == 1 and scaler.scale == 2.0**22
    assert all(torch.equal(p, before[n]) for n, p in pm.named_parameters())
    losses = [pm.step(idx[sl], tgt[sl]) for _ in range(8)]  # one batch, again and again: it must learn it
    assert all(p.dtype == torch.float16 for p in pm.parameters())
    assert losses[-1] < losses[0] - 0.1 and all(x == x for x in losses), losses
    return scaler.skipped_steps, scaler.scale, losses


def test_mixed_precision_policies():
    results = run(precision_body, 4)
    assert all(r == results[0] for r in results)  # same skips, same scale, same losses on every rank


def bad_config_body():
    from pyparallel import comm

    errors = []
    cases = [
        (dict(dp=4), dict(zero_stage=4), "zero_stage must be"),
        (dict(tp=4), dict(), "divisible by 4"),  # 2 heads cannot split 4 ways
        (dict(pp=4), dict(num_microbatches=4), "only 3 blocks"),
        (dict(pp=2, dp=2), dict(num_microbatches=1), "num_microbatches (1)"),
        (dict(dp=4), dict(optimizer=torch.optim.LBFGS), "element-wise"),
    ]
    for degrees, kwargs, text in cases:
        mesh = pyparallel.init(**degrees)
        with pytest.raises(ValueError, match=None) as info:
            pyparallel.parallelize(gpt(torch.float32, n_layer=1, n_head=2), mesh, lr=LR, **kwargs)
        assert text in str(info.value), str(info.value)
        errors.append(str(info.value))
    assert comm.comm_stats()["total"]["calls"] == 0  # every error came before the first collective
    return errors


def test_bad_configurations_fail_before_any_collective():
    run(bad_config_body, 4)
