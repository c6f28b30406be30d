"""The only module that touches ``torch.cuda`` (DESIGN.md, principle 3).

Everything else asks here for the device of a rank, the backend to use, a side stream or a
synchronisation, so that a CPU-only run never trips over a CUDA call.
"""

from __future__ import annotations

import os

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def cuda_device_count() -> int:
    """GPUs this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if cuda_available() else 0


def cuda_arch_names() -> list[str]:
    """Compute capabilities ("9.0") of the visible GPUs: what a compile-on-first-use build targets."""
    return sorted({"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(cuda_device_count())})


def default_backend() -> str:
    """NCCL when this process can use a GPU, gloo otherwise."""
    return "nccl" if cuda_available() and torch.distributed.is_nccl_available() else "gloo"


def device_for_local_rank(local_rank: int | None = None) -> torch.device:
    """The device a rank computes on: its local GPU (LOCAL_RANK modulo the visible count) or the CPU."""
    if not cuda_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def current_cuda_device() -> torch.device:
    """The CUDA device this process has selected (NCCL collectives run on it)."""
    return torch.device("cuda", torch.cuda.current_device())


def synchronize(device: torch.device | None = None) -> None:
    """Wait for queued kernels (no-op on CPU); timing code calls this before reading the clock."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Allocator peak on a GPU; None on CPU (callers measure resident memory instead)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def memory_allocated(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return None


def pin_memory_available() -> bool:
    """Pinned host memory only helps (and only works) when a GPU is present."""
    return cuda_available()


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if cuda_available():
        torch.cuda.manual_seed_all(seed)


# Generator states of the default generators, for the model-parallel RNG (tensor_parallel/random.py), which
# swaps the state dropout draws from. CPU states are ByteTensors of the Mersenne Twister; CUDA states are
# Philox (seed, offset) pairs of the given device's default generator.


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state for ``device`` (a copy)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(_cuda_index(device))
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, _cuda_index(device))
    else:
        torch.set_rng_state(state)


def seeded_rng_state(seed: int, device: torch.device) -> torch.Tensor:
    """The state a default generator of ``device`` would have after ``manual_seed(seed)``."""
    if device.type == "cuda":
        return torch.Generator(device=torch.device("cuda", _cuda_index(device))).manual_seed(seed).get_state()
    return torch.Generator().manual_seed(seed).get_state()
