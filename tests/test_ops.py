"""Compiled bucket ops against their plain-torch references: random inputs, odd sizes, several dtypes."""

import pytest
import torch

from pyparallel import _ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64]
# Every element size the copies choose their kernel by (1, 2, 4, 8, 16 bytes), in dtypes a model's buffers
# may have (a complex rotary table, float8 scales, masks).
BYTE_DTYPES = [torch.bool, torch.uint8, torch.float8_e4m3fn, torch.int16, torch.complex64, torch.complex128]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 7), (0,), (1031,), (257, 129)]


def _random(shape, dtype, gen):
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=gen)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0 if dtype == torch.uint8 else -1000, 250, shape, generator=gen).to(dtype)


def _bits(t):
    """The tensor's bytes (float8 has no torch.equal)."""
    return t.reshape(-1).view(torch.uint8)


def _copies_round_trip(device, dtype):
    assert _ops.has_kernel("flatten_into", torch.device(device))  # loads the extension
    gen = torch.Generator().manual_seed(4)
    tensors = [_random(s, dtype, gen).to(device) for s in SHAPES]
    total = sum(t.numel() for t in tensors)
    out = torch.zeros(total + 3, dtype=dtype, device=device)
    tail = _bits(out[total:]).clone()
    torch.ops.pyparallel.flatten_into(tensors, out)
    assert torch.equal(_bits(out[:total]), torch.cat([_bits(t) for t in tensors]))
    assert torch.equal(_bits(out[total:]), tail)
    outs = [torch.empty_like(t) for t in tensors]
    torch.ops.pyparallel.unflatten_from(out, outs)
    for a, t in zip(outs, tensors):
        assert torch.equal(_bits(a), _bits(t))


@pytest.mark.parametrize("dtype", BYTE_DTYPES)
def test_flatten_moves_the_bits_of_every_dtype(dtype):
    _copies_round_trip("cpu", dtype)


def test_conjugate_and_negative_views_are_copied_as_their_values():
    assert _ops.has_kernel("flatten_into", torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(7, dtype=torch.complex64, generator=gen)
    views = [z.conj(), torch.randn(5, dtype=torch.complex64, generator=gen).conj().imag]  # a conj, a neg view
    assert views[0].is_conj() and views[1].is_neg()
    out = torch.empty(12, dtype=torch.complex64)
    torch.ops.pyparallel.flatten_into([views[0], views[1].to(torch.complex64)], out)
    assert torch.equal(out[:7], z.conj().resolve_conj())
    neg = views[1]
    flat = torch.empty(5)
    torch.ops.pyparallel.flatten_into([neg], flat)
    assert torch.equal(flat, neg.resolve_neg())


def test_extension_is_built():
    assert _ops.HAS_EXT, f"pyparallel._C failed to import: {_ops._EXT_ERROR}"
    assert _ops.has_kernel("flatten_into", torch.device("cpu"))
    assert _ops.has_kernel("unflatten_from", torch.device("cpu"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_flatten_unflatten_match_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = [_random(s, dtype, gen) for s in SHAPES]
    total = sum(t.numel() for t in tensors)
    pad = 5  # buckets are padded: the tail must be left alone
    out = torch.full((total + pad,), 3, dtype=dtype)
    ref = out.clone()
    torch.ops.pyparallel.flatten_into(tensors, out)
    _ops.flatten_into_reference(tensors, ref)
    assert torch.equal(out, ref)
    assert torch.equal(out[total:], torch.full((pad,), 3, dtype=dtype))

    outs = [torch.zeros_like(t) for t in tensors]
    refs = [torch.zeros_like(t) for t in tensors]
    torch.ops.pyparallel.unflatten_from(out, outs)
    _ops.unflatten_from_reference(out, refs)
    for a, b, t in zip(outs, refs, tensors):
        assert torch.equal(a, b) and torch.equal(a, t)


def test_large_tensors_use_the_parallel_path():
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(300_001, generator=gen), torch.randn(3, generator=gen), torch.randn(200_003, generator=gen)]
    out = torch.empty(500_007)
    torch.ops.pyparallel.flatten_into(tensors, out)
    assert torch.equal(out, torch.cat(tensors))


def test_non_contiguous_and_casting_inputs():
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(6, 9, generator=gen)
    tensors = [base.t(), base[:, ::2], torch.randn(4, generator=gen).to(torch.bfloat16)]
    out = torch.empty(sum(t.numel() for t in tensors))
    ref = torch.empty_like(out)
    _ops.flatten_into(tensors, out)
    _ops.flatten_into_reference(tensors, ref)
    assert torch.equal(out, ref)
    views = [torch.empty(6, 9).t(), torch.empty(6, 5), torch.empty(4, dtype=torch.bfloat16)]
    _ops.unflatten_from(out, views)
    for v, t in zip(views, tensors):
        assert torch.equal(v, t)


def test_too_small_buffer_is_an_error():
    with pytest.raises(ValueError, match="hold 10 elements but the flat buffer only 9"):
        _ops.flatten_into([torch.zeros(10)], torch.zeros(9))
    with pytest.raises(RuntimeError, match="flat buffer only 9"):
        torch.ops.pyparallel.flatten_into([torch.zeros(10)], torch.zeros(9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run by benchmarks/gpu_check.sh)")
@pytest.mark.parametrize("dtype", BYTE_DTYPES)
def test_cuda_flatten_moves_the_bits_of_every_dtype(dtype):
    _copies_round_trip("cuda", dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run by benchmarks/gpu_check.sh)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cuda_flatten_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    tensors = [_random(s, dtype, gen).cuda() for s in SHAPES]
    total = sum(t.numel() for t in tensors)
    out = torch.full((total + 3,), 7, dtype=dtype, device="cuda")
    torch.ops.pyparallel.flatten_into(tensors, out)
    assert torch.equal(out[:total], torch.cat([t.flatten() for t in tensors]))
    assert torch.equal(out[total:].cpu(), torch.full((3,), 7, dtype=dtype))
    outs = [torch.empty_like(t) for t in tensors]
    torch.ops.pyparallel.unflatten_from(out, outs)
    for a, t in zip(outs, tensors):
        assert torch.equal(a, t)


def test_pure_python_fallback_warns_once(monkeypatch):
    monkeypatch.setattr(_ops, "HAS_EXT", False)
    monkeypatch.setattr(_ops, "_warned", False)
    out = torch.empty(4)
    with pytest.warns(RuntimeWarning, match="plain-torch reference"):
        _ops.flatten_into([torch.ones(4)], out)
    assert torch.equal(out, torch.ones(4))
