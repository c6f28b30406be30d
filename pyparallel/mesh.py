"""ParallelMesh: the dp x tp x pp layout of the ranks and a process group per axis.

Global rank = pp_index * (dp * tp) + dp_index * tp + tp_index: tensor parallelism is innermost, so a TP
group is a run of consecutive ranks, which torchrun places on one node (TP's per-layer all-reduces need
the fastest links; Megatron-LM, Shoeybi et al. 2019, orders its groups the same way). Pipeline stages
are outermost: neighbouring stages talk point to point, a few activations per micro-batch.

The mesh is passed explicitly to every wrapper, layer and schedule; nothing is global, so two meshes can
live in one process.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pyparallel import comm, device


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def resolve_degrees(world_size: int, dp: int | None, tp: int, pp: int) -> tuple[int, int, int]:
    """Check (and complete, when dp is None) the degrees against the world size; no communication."""
    tp = _positive_int("tp", tp)
    pp = _positive_int("pp", pp)
    if dp is None:
        if world_size % (tp * pp) != 0:
            raise ValueError(
                f"the world size {world_size} is not divisible by tp ({tp}) x pp ({pp}) = {tp * pp}; "
                f"choose tp and pp whose product divides {world_size}"
            )
        dp = world_size // (tp * pp)
    dp = _positive_int("dp", dp)
    if dp * tp * pp != world_size:
        raise ValueError(
            f"dp ({dp}) x tp ({tp}) x pp ({pp}) = {dp * tp * pp} does not equal the world size {world_size}; "
            f"the three degrees must multiply to the number of processes (e.g. dp={world_size // (tp * pp) or 1}, "
            f"tp={tp}, pp={pp} when tp x pp divides {world_size})"
        )
    return dp, tp, pp


@dataclass(frozen=True)
class Coords:
    dp: int
    tp: int
    pp: int


class ParallelMesh:
    """Process groups for a dp x tp x pp layout of the (already initialised) default group.

    Every rank must construct the mesh, with the same degrees, at the same point: group creation is a
    collective over the world. Degrees are validated before any group is created.
    """

    def __init__(self, dp: int | None = None, tp: int = 1, pp: int = 1, *, timeout_s: float | None = None,
                 backend: str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs torch.distributed initialised; call pyparallel.init() instead")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.dp, self.tp, self.pp = resolve_degrees(self.world_size, dp, tp, pp)
        self.timeout_s = float(timeout_s if timeout_s is not None else _env_timeout())
        self.backend = backend or dist.get_backend()
        self.device = (
            device.device_for_local_rank() if self.backend == "nccl" else torch.device("cpu")
        )
        self.coords = self.coords_of(self.rank)
        self.world_group = comm.new_group(range(self.world_size), "world", self.timeout_s, self.backend)
        comm.register_processes(self.world_group)  # so a lost peer is named by its global rank
        self.tp_group = self._make_axis("tp")
        self.dp_group = self._make_axis("dp")
        self.pp_group = self._make_axis("pp")

    # ----------------------------------------------------------------------------------- layout

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        return pp * (self.dp * self.tp) + dp * self.tp + tp

    def coords_of(self, rank: int) -> Coords:
        return Coords(dp=(rank // self.tp) % self.dp, tp=rank % self.tp, pp=rank // (self.dp * self.tp))

    def axis_ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of ``rank``'s group along ``axis`` (in group order)."""
        c = self.coords_of(self.rank if rank is None else rank)
        if axis == "tp":
            return [self.rank_of(c.dp, t, c.pp) for t in range(self.tp)]
        if axis == "dp":
            return [self.rank_of(d, c.tp, c.pp) for d in range(self.dp)]
        if axis == "pp":
            return [self.rank_of(c.dp, c.tp, p) for p in range(self.pp)]
        raise ValueError(f"unknown mesh axis {axis!r}; axes are 'dp', 'tp', 'pp'")

    def _make_axis(self, axis: str) -> comm.Group:
        # Every rank creates every group of the axis, in the same order (new_group is a world collective).
        seen, mine = set(), None
        for r in range(self.world_size):
            ranks = tuple(self.axis_ranks(axis, r))
            if ranks in seen:
                continue
            seen.add(ranks)
            g = comm.new_group(ranks, axis, self.timeout_s, self.backend)
            if g is not None:
                mine = g
        return mine

    # ------------------------------------------------------------------------------ conveniences

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    def group(self, axis: str) -> comm.Group:
        return {"dp": self.dp_group, "tp": self.tp_group, "pp": self.pp_group, "world": self.world_group}[axis]

    def __repr__(self) -> str:
        return (f"ParallelMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}, rank={self.rank}, "
                f"coords={self.coords}, backend={self.backend!r})")


def _env_timeout() -> float:
    return float(os.environ.get("PYPARALLEL_TIMEOUT", comm.DEFAULT_TIMEOUT_S))


def _init_from_env(backend: str, timeout: datetime.timedelta) -> None:
    """``init_process_group`` from torchrun's / launch's environment.

    Under torchrun, on a store prefixed by the restart attempt: the elastic agent keeps one store across
    ``--max-restarts`` attempts, so a restarted attempt's process groups could read the addresses that the
    previous attempt's dead workers published under the same keys and fail with "connectFullMesh ...
    Connection refused". A per-attempt prefix gives every attempt fresh keys. The agents' restart counts
    agree only while the same agents run every attempt: a node that rejoins an elastic job is a new agent
    whose count starts at 0. Such jobs run without the shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    docs/multinode.md): each rendezvous round then starts its own store for the workers, whose keys are
    fresh, and no prefix is needed."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"/pyparallel/attempt_{attempt}", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def init(dp: int | None = None, tp: int = 1, pp: int = 1, *, backend: str | None = None,
         timeout_s: float | None = None) -> ParallelMesh:
    """Initialise torch.distributed from the environment (torchrun, ``pyparallel.launch``, or nothing for
    a single process) and return the :class:`ParallelMesh` for the given degrees.

    ``dp=None`` takes what is left: world_size / (tp * pp). A layout that does not fit the world size
    raises ValueError before any process group is created. ``timeout_s`` bounds every collective
    (default 300 s, or ``PYPARALLEL_TIMEOUT``).
    """
    timeout_s = float(timeout_s if timeout_s is not None else _env_timeout())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized():
        world_size = dist.get_world_size()
    resolve_degrees(world_size, dp, tp, pp)  # fail before touching the network
    if not dist.is_initialized():
        backend = backend or device.default_backend()
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            if backend == "nccl":
                device.device_for_local_rank()
            _init_from_env(backend, timeout)
        else:  # a plain `python script.py`: a world of one
            store = dist.HashStore()
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    return ParallelMesh(dp, tp, pp, timeout_s=timeout_s, backend=backend)


def shutdown() -> None:
    """Tear down this process's process groups; a no-op when there are none. Call it as the last step of
    a script that torchrun starts (``pyparallel.launch`` does it for its own workers). Without it a gloo
    group is torn down by the interpreter's exit, while its worker thread may still be releasing the last
    collective's tensors: that thread needs the GIL of an interpreter that is finalizing, and the process
    aborts ("terminate called without an active exception", pytorch/pytorch#190489) after its work is
    done, so torchrun reports the job failed. Here every group is released and collected while the
    interpreter is whole, so its destructor joins those threads first. Groups, meshes and models built on
    them cannot communicate afterwards."""
    if not dist.is_initialized():
        return
    comm.close_groups()
    dist.destroy_process_group()
    gc.collect()  # process groups held only by reference cycles (modules <-> engines) go now, not at exit
