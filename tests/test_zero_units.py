"""Single-process pieces of ZeRO: shard arithmetic, the in-device updater, the loss-scale schedule."""

import pytest
import torch

from pyparallel import _ops
from pyparallel.amp import DynamicLossScaler, MixedPrecision, scale_outputs
from pyparallel.zero.flat_param import FlatLayout, ShardSpace, padded_size, plan_buckets
from pyparallel.zero.updater import DeviceUpdater


def test_padding_and_shard_ranges():
    assert [padded_size(n, 4) for n in (0, 1, 3, 4, 5, 8)] == [4, 4, 4, 4, 8, 8]
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(3, 5), (7,), (1,)]]  # 23 elements
    lay = FlatLayout(["a", "b", "c"], params, world=4)
    assert (lay.numel, lay.padded, lay.shard_numel, lay.padding) == (23, 24, 6, 1)
    assert lay.offsets == [0, 15, 22] and lay.shard_range(3) == (18, 24)
    flat = lay.flatten(params, torch.float32, "cpu")
    assert flat[23] == 0  # padding is zero
    for view, p in zip(lay.split_views(flat), params):
        assert torch.equal(view, p.detach())
    tiny = FlatLayout(["g"], [torch.nn.Parameter(torch.ones(1))], world=4)
    assert tiny.padded == 4 and tiny.shard_numel == 1  # ranks 1..3 own only padding
    space = ShardSpace([lay, tiny], rank=1)
    assert space.numel == 7 and space.offsets == [0, 6] and space.padded_numel == 28
    out = space.new(torch.float32, "cpu")
    space.shard_of([flat, tiny.flatten(tiny.params, torch.float32, "cpu")], out)
    assert torch.equal(space.slice(out, 0), flat[6:12]) and out[6] == 0


def test_buckets_fill_from_the_last_parameter():
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(100))) for i in range(5)]
    # Filled until they hold the cap or more: 300 elements each (over by at most the last parameter).
    layouts = plan_buckets(named, cap_bytes=250 * 4, world=2, elem_bytes=4)
    assert [lay.names for lay in layouts] == [["p4", "p3", "p2"], ["p1", "p0"]]
    exact = plan_buckets(named, cap_bytes=200 * 4, world=2, elem_bytes=4)  # reaching the cap closes a bucket
    assert [lay.names for lay in exact] == [["p4", "p3"], ["p2", "p1"], ["p0"]]
    with pytest.raises(ValueError, match="bucket capacity must be positive"):
        plan_buckets(named, 0, 2, 4)


def _run_updater(fuse, out_dtype, steps=5):
    master = torch.randn(1001, generator=torch.Generator().manual_seed(0)).clone()
    ranges = [(0, 400), (400, 1001)]  # two runs: two tensors of the inner optimizer, in two param groups

    def build(ps):
        return torch.optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}], lr=1e-2,
                                 weight_decay=0.1)

    updater = DeviceUpdater([master[s:e] for s, e in ranges], ranges, build, torch.device("cpu"), fuse=fuse)
    updater.master = master
    out = torch.empty(1001, dtype=out_dtype)
    for s in range(steps):
        updater.push_grad(torch.randn(1001, generator=torch.Generator().manual_seed(10 + s)))
        updater.step(out)
        updater.wait()
    return updater, out


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fused_updater_matches_torch_adamw(out_dtype):
    fused, out_f = _run_updater(True, out_dtype)
    plain, out_p = _run_updater(False, out_dtype)
    assert fused.fused == _ops.has_kernel("adam_step", torch.device("cpu")) and not plain.fused
    torch.testing.assert_close(fused.master, plain.master)
    assert torch.equal(out_f, fused.master.to(out_dtype))  # the compute copy is the rounded master
    for p in fused.params:
        state = fused.optimizer.state[p]
        assert int(state["step"]) == 5 and set(state) >= {"exp_avg", "exp_avg_sq"}
    assert fused.state_bytes()["optimizer"] == 2 * 1001 * 4 + 2 * 4  # moments, and one step count per run
    assert [g["weight_decay"] for g in fused.optimizer.param_groups] == [0.1, 0.0]


def test_loss_scaler_schedule_and_output_scaling():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2, min_scale=2.0)
    s.update(False)
    s.update(False)
    assert s.scale == 16.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0 and s.skipped_steps == 5  # never below min_scale
    x = torch.ones(3, requires_grad=True)
    y = scale_outputs({"loss": (x * 2).sum()}, s)["loss"]
    assert y.item() == 6.0  # the value is untouched
    y.backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0 * s.scale))  # the gradient is scaled
    assert DynamicLossScaler.local_overflow(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="param_dtype must be"):
        MixedPrecision(torch.int32)
    assert MixedPrecision(torch.float16).needs_loss_scaling and not MixedPrecision(torch.bfloat16).needs_loss_scaling
