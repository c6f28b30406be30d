"""The fused ``gelu_linear`` op against ``F.gelu(z + b) @ w.T``: values and gradients on odd shapes, fp32 and
16-bit, both GeLU forms, gradcheck in float64, what autograd saves, errors; CUDA variants where a GPU is."""

import pytest
import torch
import torch.nn.functional as F
from dist import run

import pyparallel
from pyparallel import _ops

FORMS = ["none", "tanh"]
# Odd sizes; the last two span several of the kernel's row blocks (forward) and column blocks (backward).
SHAPES = [((1,), 1, 1), ((5,), 3, 7), ((3, 37), 129, 23), ((700,), 600, 33), ((2, 150), 1030, 17)]
close = torch.testing.assert_close


@pytest.fixture(params=["blocked", "whole"])
def backward_path(request, monkeypatch):
    """The CPU backward has two strategies (column-blocked in cache; whole-matrix GEMMs for tall inputs),
    chosen by shape; every CPU check runs with each forced."""
    monkeypatch.setenv("PYPARALLEL_GELU_LINEAR_BACKWARD", request.param)
    return request.param


def _inputs(lead, k, n, dtype, device="cpu", bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*lead, k, generator=gen) * 2
    b = torch.randn(k, generator=gen) if bias else None
    w = torch.randn(n, k, generator=gen) / k**0.5
    g = torch.randn(*lead, n, generator=gen)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(z), cast(b), cast(w), cast(g)


def _grads(fn, z, b, w, g):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (z, b, w)]
    y = fn(*leaves)
    y.backward(g)
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def _reference(z, b, w, g, approximate):
    return _grads(lambda z_, b_, w_: _ops.gelu_linear_reference(z_, b_, w_, approximate), z, b, w, g)


def _fused(z, b, w, g, approximate):
    return _grads(lambda z_, b_, w_: _ops.gelu_linear(z_, b_, w_, approximate), z, b, w, g)


def test_cpu_kernel_is_registered():
    assert _ops.HAS_EXT, f"the extension did not load: {_ops._EXT_ERROR}"
    assert _ops._gelu_linear_kernel(torch.device("cpu"))


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_matches_reference(shape, approximate, bias, backward_path):
    z, b, w, g = _inputs(*shape, torch.float32, bias=bias)
    got, want = _fused(z, b, w, g, approximate), _reference(z, b, w, g, approximate)
    for name, a, e in zip(["y", "dz", "db", "dw"], got, want):
        if e is None:
            assert a is None
            continue
        close(a, e, msg=lambda m, name=name: f"{name}: {m}")


def _no_worse_than_eager(got, eager, exact, dtype):
    """Error against the float64 computation on the same inputs no larger than eager PyTorch's own error
    in ``dtype`` (plus a sliver of the output's scale)."""
    for name, a, e, x in zip(["y", "dz", "db", "dw"], got, eager, exact):
        assert a.dtype == dtype
        err, eager_err = (a.double() - x).abs().max(), (e.double() - x).abs().max()
        assert err <= 1.5 * eager_err + 1e-3 * x.abs().max(), f"{name}: fused {err:.3g} vs eager {eager_err:.3g}"


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("shape", SHAPES[3:], ids=str)
def test_fp32_long_reductions_as_accurate_as_eager(shape, approximate, backward_path):
    """With hundreds of rows the weight gradient sums hundreds of O(10) products: fp32 rounding alone
    moves near-zero entries by ~5e-5, in the plain-torch reference as much as in the kernel (both are
    that far from float64), so here both are held to the float64 result and the kernel must be at
    least as accurate as the reference."""
    z, b, w, g = _inputs(*shape, torch.float32)
    exact = _reference(*(t.double() for t in (z, b, w, g)), approximate)
    _no_worse_than_eager(_fused(z, b, w, g, approximate), _reference(z, b, w, g, approximate), exact,
                         torch.float32)


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[2:], ids=str)
def test_low_precision_no_worse_than_eager(shape, dtype, approximate, backward_path):
    """16-bit: the fused op's error against an fp32 computation on the same (rounded) inputs is no larger
    than eager PyTorch's own 16-bit error (plus a sliver of the output's scale)."""
    z, b, w, g = _inputs(*shape, dtype)
    eager = _grads(lambda z_, b_, w_: F.gelu(z_ + b_, approximate=approximate) @ w_.t(), z, b, w, g)
    exact = _reference(*(t.double() for t in (z, b, w, g)), approximate)
    _no_worse_than_eager(_fused(z, b, w, g, approximate), eager, exact, dtype)


@pytest.mark.parametrize("approximate", FORMS)
def test_gradcheck_float64(approximate, backward_path):
    z, b, w, _ = _inputs((2, 3), 5, 4, torch.float64)
    args = [t.requires_grad_() for t in (z, b, w)]
    assert torch.autograd.gradcheck(lambda z_, b_, w_: _ops.gelu_linear(z_, b_, w_, approximate), args)
    assert torch.autograd.gradcheck(lambda z_, w_: _ops.gelu_linear(z_, None, w_, approximate), [args[0], args[2]])


def test_only_some_inputs_need_grad(backward_path):
    z, b, w, g = _inputs((4, 9), 11, 6, torch.float32)
    want = _reference(z, b, w, g, "tanh")
    wl = w.clone().requires_grad_()
    _ops.gelu_linear(z, b, wl, "tanh").backward(g)  # z, b constants: only the weight gradient
    close(wl.grad, want[3])
    zl = z.clone().requires_grad_()
    _ops.gelu_linear(zl, b, w, "tanh").backward(g)
    close(zl.grad, want[1])


def test_autograd_saves_only_z_and_parameters():
    z, b, w, g = _inputs((6, 5), 40, 8, torch.float32)
    z.requires_grad_(), b.requires_grad_(), w.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = _ops.gelu_linear(z, b, w, "none")
    assert {t.data_ptr() for t in saved} == {z.data_ptr(), b.data_ptr(), w.data_ptr()}
    assert sum(t.numel() for t in saved if t.shape == z.shape) == z.numel()  # one [.., K] tensor: z itself
    y.backward(g)


def test_fallback_recomputes_too():
    z, b, w, g = _inputs((3, 4), 17, 5, torch.float32)
    got = _grads(lambda z_, b_, w_: _ops._GeluLinearRecompute.apply(z_, b_, w_, "tanh"), z, b, w, g)
    for a, e in zip(got, _reference(z, b, w, g, "tanh")):
        close(a, e)


EMPTY = [((0,), 5, 3), ((2, 0), 4, 6), ((3,), 0, 4), ((3,), 4, 0), ((0, 2), 0, 0)]  # no rows / K = 0 / N = 0


def _empty_case(shape, device):
    z, b, w, g = _inputs(*shape, torch.float32, device=device)
    got, want = _fused(z, b, w, g, "tanh"), _reference(z, b, w, g, "tanh")
    for name, a, e in zip(["y", "dz", "db", "dw"], got, want):
        assert a.shape == e.shape, name
        close(a, e, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("shape", EMPTY, ids=str)
def test_empty_dimensions(shape, backward_path):
    """Zero rows, a zero-width input (a shard with no columns) or no outputs: the reference's shapes and
    values (zeros where a sum is empty), not an error."""
    _empty_case(shape, "cpu")


def test_bad_input_raises():
    z, b, w, _ = _inputs((3,), 8, 4, torch.float32)
    with pytest.raises(ValueError, match="approximate"):
        _ops.gelu_linear(z, b, w, "sigmoid")
    with pytest.raises(ValueError, match=r"weight must be \[out_features, 8\]"):
        _ops.gelu_linear(z, b, w.t(), "none")
    with pytest.raises(ValueError, match=r"bias has shape \(4,\), expected \(8,\)"):
        _ops.gelu_linear(z, b[:4], w, "none")
    with pytest.raises(RuntimeError, match="pyparallel::gelu_linear: z is Float but weight is Double"):
        torch.ops.pyparallel.gelu_linear(z, b, w.double(), "none")


def mlp_saved_body():
    """ParallelMLP (t ranks): besides parameters, backward keeps the input x and Z, never GeLU(Z)."""
    from pyparallel.models.gpt import MLP, gpt_config
    from pyparallel.tensor_parallel import ParallelMLP

    mesh = pyparallel.init(tp=torch.distributed.get_world_size())
    torch.manual_seed(0)
    mlp = ParallelMLP.from_module(MLP(gpt_config("tiny", n_embd=16, n_head=2)), mesh)
    params = {p.data_ptr() for p in mlp.parameters()}
    x = torch.randn(2, 7, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = mlp(x)
    acts = [t for t in saved if t.data_ptr() not in params]
    z = F.linear(x, mlp.column.weight)
    assert len(acts) == 2, [tuple(t.shape) for t in acts]
    assert acts[0].data_ptr() == x.data_ptr()  # for fc_in's weight gradient
    close(acts[1], z)  # Z, the pre-activation without bias; GeLU(Z + b) is recomputed in backward
    y.sum().backward()
    return sum(t.numel() for t in acts)


def test_parallel_mlp_saves_only_z():
    sizes = run(mlp_saved_body, 2)
    assert sizes[0] == 2 * 7 * 16 + 2 * 7 * 64 // 2  # x [b, s, h] + Z [b, s, 4h/t]


# ------------------------------------------------------------------------------ CUDA (GPU machines)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run benchmarks/gpu_check.sh)")
CUDA_SHAPES = SHAPES + [((4, 257), 1600, 400), ((3, 100), 96, 1000)]


@cuda
@pytest.mark.parametrize("shape", EMPTY, ids=str)
def test_cuda_empty_dimensions(shape):
    _empty_case(shape, "cuda")


@cuda
def test_cuda_kernel_is_registered():
    assert _ops._gelu_linear_kernel(torch.device("cuda")), "the extension was built without CUDA kernels"


@cuda
@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_full_precision(shape, dtype, approximate):
    z, b, w, g = _inputs(*shape, dtype, device="cuda")
    got, want = _fused(z, b, w, g, approximate), _reference(z, b, w, g, approximate)
    if dtype == torch.float32 and shape not in SHAPES[:3]:  # long fp32 reductions: see the CPU twin
        exact = _reference(*(t.double() for t in (z, b, w, g)), approximate)
        _no_worse_than_eager(got, want, exact, dtype)
        return
    for name, a, e in zip(["y", "dz", "db", "dw"], got, want):
        close(a, e, msg=lambda m, name=name: f"{name}: {m}")


@cuda
@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("shape", CUDA_SHAPES[2:], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_tensor_cores_no_worse_than_eager(shape, dtype, approximate):
    z, b, w, g = _inputs(*shape, dtype, device="cuda")
    eager = _grads(lambda z_, b_, w_: F.gelu(z_ + b_, approximate=approximate) @ w_.t(), z, b, w, g)
    exact = _reference(*(t.double() for t in (z, b, w, g)), approximate)
    _no_worse_than_eager(_fused(z, b, w, g, approximate), eager, exact, dtype)


@cuda
def test_cuda_gradcheck_and_stream():
    z, b, w, _ = _inputs((2, 3), 5, 4, torch.float64, device="cuda")
    args = [t.requires_grad_() for t in (z, b, w)]
    assert torch.autograd.gradcheck(lambda z_, b_, w_: _ops.gelu_linear(z_, b_, w_, "tanh"), args)
    stream = torch.cuda.Stream()
    z, b, w, _ = _inputs((64,), 256, 128, torch.bfloat16, device="cuda")
    with torch.cuda.stream(stream):  # launches on the current stream, not the default one
        y = _ops.gelu_linear(z, b, w, "none")
    stream.synchronize()
    close(y.float(), _ops.gelu_linear_reference(z.float(), b.float(), w.float(), "none"), atol=0.05, rtol=0.02)
