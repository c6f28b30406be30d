"""pyparallel: data, ZeRO, tensor and pipeline parallel training on torch.distributed.

The public API and nothing else; see README.md for a tour. Names are imported on first use (PEP 562), so
``pyparallel plan`` starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Eager: launch.py needs only the standard library, and binding the function here keeps
# `pyparallel.launch` the function even after `import pyparallel.launch` loads the module of that name.
from pyparallel.launch import LaunchError, launch

__version__ = "0.1.0"

_EXPORTS = {
    "init": "pyparallel.mesh",
    "shutdown": "pyparallel.mesh",
    "ParallelMesh": "pyparallel.mesh",
    "DataParallel": "pyparallel.data_parallel.ddp",
    "comm_stats": "pyparallel.comm",
    "reset_comm_stats": "pyparallel.comm",
    "CollectiveError": "pyparallel.comm",
    "CollectiveTimeoutError": "pyparallel.comm",
    "CollectiveMismatchError": "pyparallel.comm",
    "parallelize": "pyparallel.parallel",
    "ParallelModel": "pyparallel.parallel",
    "MixedPrecision": "pyparallel.amp",
    "shard_batch": "pyparallel.data",
    "dp_mean": "pyparallel.data",
}
_SUBMODULES = {
    "comm", "device", "mesh", "checkpoint", "memory", "amp", "zero", "optim", "tensor_parallel",
    "pipeline_parallel", "planner", "bench", "models", "data_parallel", "data", "accounting",
    "parallel", "combined", "train",
}

__all__ = ["LaunchError", "launch", *sorted(_EXPORTS), *sorted(_SUBMODULES)]

if TYPE_CHECKING:  # for type checkers and IDEs only
    from pyparallel.amp import MixedPrecision  # noqa: F401
    from pyparallel.comm import (  # noqa: F401
        CollectiveError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
        comm_stats,
        reset_comm_stats,
    )
    from pyparallel.data import dp_mean, shard_batch  # noqa: F401
    from pyparallel.data_parallel.ddp import DataParallel  # noqa: F401
    from pyparallel.mesh import ParallelMesh, init  # noqa: F401
    from pyparallel.parallel import ParallelModel, parallelize  # noqa: F401


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"pyparallel.{name}")
    else:
        raise AttributeError(f"module 'pyparallel' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
