"""Optimizers with compiled kernels: the CPU Adam of ZeRO-Offload and its CUDA twin."""

from pyparallel.optim.cpu_adam import CPUAdam, FusedAdam, set_simd_level, simd_level, supported_simd_levels

__all__ = ["CPUAdam", "FusedAdam", "set_simd_level", "simd_level", "supported_simd_levels"]
