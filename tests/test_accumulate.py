"""pyparallel.zero.accumulate: Linear / Embedding weight gradients added straight into a ``.grad`` buffer.

Against the plain layers on random inputs of odd sizes: the same input, bias and weight gradients (fp64:
the sums differ only in order), accumulated onto what the buffer already held; no full-size weight
gradient is ever made while the buffer is there; the layer falls back to torch's gradient where it is not.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from pyparallel.zero import accumulate


class FullSizeOutputs(TorchDispatchMode):
    """Records the ops that make a new tensor of ``numel`` elements (not in place, not a view)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema  # in-place, out= and view ops make no new storage
        aliases = any(r.alias_info is not None for r in schema.returns)
        if isinstance(out, torch.Tensor) and out.numel() == self.numel and not aliases \
                and out.untyped_storage().nbytes() >= self.numel * out.element_size():
            self.made.append(str(func))
        return out


def pair(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "linear":
        plain = nn.Linear(37, 53, dtype=torch.float64)
    elif kind == "linear-nobias":
        plain = nn.Linear(37, 53, bias=False, dtype=torch.float64)
    else:
        plain = nn.Embedding(61, 19, padding_idx=3 if kind == "embedding-pad" else None, dtype=torch.float64)
    fused = type(plain)(*([37, 53] if kind.startswith("linear") else [61, 19]),
                        **({"bias": plain.bias is not None} if kind.startswith("linear") else
                           {"padding_idx": plain.padding_idx}), dtype=torch.float64)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def inputs(kind, step):
    g = torch.Generator().manual_seed(100 + step)
    if kind.startswith("linear"):
        return torch.randn(3, 7, 37, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.randint(0, 61, (5, 11), generator=g)
    ids[0, :4] = 3  # the padding row (when there is one) and repeated ids
    return ids


@pytest.mark.parametrize("kind", ["linear", "linear-nobias", "embedding", "embedding-pad"])
def test_accumulates_into_the_buffer_like_torch(kind):
    plain, fused = pair(kind)
    assert accumulate.install([fused], {id(fused.weight)}) == 1
    start = torch.randn(fused.weight.shape, dtype=torch.float64)
    plain.weight.grad = start.clone()
    buffer = start.clone()
    fused.weight.grad = buffer  # as the engine attaches a view of its flat buffer
    for step in range(2):  # two micro-batches accumulate
        x = inputs(kind, step)
        xf = x.detach().clone().requires_grad_(x.requires_grad)
        w = torch.randn(*x.shape[:2], fused.weight.shape[0] if kind.startswith("linear") else 19,
                        dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        (plain(x) * w).sum().backward()
        made = FullSizeOutputs(fused.weight.numel())
        with made:
            (fused(xf) * w).sum().backward()
        assert made.made == [], made.made  # the weight's gradient never existed at full size
        assert fused.weight.grad is buffer  # still the buffer, added to in place
        torch.testing.assert_close(buffer, plain.weight.grad, rtol=1e-13, atol=1e-13)
        if x.requires_grad:
            torch.testing.assert_close(xf.grad, x.grad, rtol=0, atol=0)
        if getattr(plain, "bias", None) is not None:
            torch.testing.assert_close(fused.bias.grad, plain.bias.grad, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["linear", "embedding-pad"])
def test_without_a_buffer_it_is_torch(kind):
    """No ``.grad`` yet (or one of another dtype): the gradient is computed and handed to autograd."""
    plain, fused = pair(kind)
    accumulate.install([fused], {id(fused.weight)})
    for step in range(2):
        x = inputs(kind, step)
        (plain(x) ** 2).sum().backward()
        (fused(x.detach().clone().requires_grad_(x.requires_grad)) ** 2).sum().backward()
        torch.testing.assert_close(fused.weight.grad, plain.weight.grad, rtol=1e-13, atol=1e-13)


def test_only_plain_layers_whose_weight_the_engine_buffers():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), MyLinear(4, 4), nn.Embedding(8, 4, max_norm=1.0), nn.Linear(4, 4))
    frozen = model[3]
    frozen.weight.requires_grad_(False)
    ids = {id(p) for p in model.parameters()}
    assert accumulate.install([model], ids) == 1
    assert "forward" in vars(model[0]) and all("forward" not in vars(m) for m in model[1:])
