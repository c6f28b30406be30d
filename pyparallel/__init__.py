"""pyparallel: data, ZeRO, tensor and pipeline parallel training on torch.distributed.

The public API and nothing else; see README.md for a tour and DESIGN.md for the architecture.
"""

from pyparallel.comm import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    comm_stats,
    reset_comm_stats,
)
from pyparallel.data_parallel.ddp import DataParallel
from pyparallel.launch import LaunchError, launch
from pyparallel.mesh import ParallelMesh, init

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DataParallel",
    "LaunchError",
    "ParallelMesh",
    "comm_stats",
    "init",
    "launch",
    "reset_comm_stats",
]
