"""DeepSpeed's ZeRO engine as a bench peer (``--peers`` whenever ``deepspeed`` imports).

The rows ``deepspeed-zero1/2/3`` and ``deepspeed-zero3-offload`` train the same ``GPT(cfg, seed)`` on the
same rows of the same batches as ours, built through ``deepspeed.initialize`` with a configuration that
means what our rows mean: AdamW (lr, betas, eps, weight decay of :class:`~pyparallel.bench.adapter.Hyper`),
fp32 weights, gradients and reductions (with ``--dtype bf16``: bf16 weights and compute, fp32 master weights
and reductions), no clipping, one micro-batch per step, the ZeRO stage of the row.
Everything else is DeepSpeed's default (bucket sizes, ``overlap_comm``, stage 3's persistence threshold),
because that is what a user who picks DeepSpeed gets. Without offload the optimizer is ``torch.optim.AdamW``
(``torch_adam``: DeepSpeed's FusedAdam needs a GPU); with offload it is DeepSpeed's own CPU Adam
(``DeepSpeedCPUAdam``, compiled on first use), as in ZeRO-Offload (Ren et al. 2021).

On a CPU DeepSpeed must be told its accelerator (``DS_ACCELERATOR=cpu``) before it is first imported; it
then runs its collectives over the gloo process group pyparallel already created. Its traffic comes from
its own comms logger (``deepspeed.comm``), switched on for the untimed warm-up steps only, since the logger
times every call and would slow the steps we time.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings

import torch

from pyparallel.bench.adapter import Adapter, dp_rows
from pyparallel.bench.measure import count_model_states

# name: (our row it is compared with, ZeRO stage, optimizer state on the host)
ROWS = {
    "deepspeed-zero1": ("zero1", 1, False),
    "deepspeed-zero2": ("zero2", 2, False),
    "deepspeed-zero3": ("zero3", 3, False),
    "deepspeed-zero3-offload": ("zero3-offload", 3, True),
}


def _prefer_cpu_accelerator() -> None:
    """DeepSpeed picks its accelerator once, at import; without a GPU it must be the CPU one."""
    from pyparallel import device

    if not device.cuda_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _quiet() -> None:
    """DeepSpeed 0.19 calls torch.distributed's deprecated ``*_tensor`` collectives on every step; their
    FutureWarnings would bury the bench's own output (they say nothing about the row)."""
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.distributed\.")


def preload(backend: str) -> None:
    """Import DeepSpeed and let it wrap the process group before any row is measured, so that its import
    and the ops it compiles on first use (its shared-memory all-reduce on CPUs) do not land in the first
    DeepSpeed row's memory or build time. Called by the bench's worker on every rank."""
    _prefer_cpu_accelerator()
    _quiet()
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    # torch.distributed is up already (pyparallel.init): DeepSpeed wraps its default group.
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    # One throwaway step of a tiny engine: what deepspeed.initialize and its first step import and allocate
    # once per process (tens of MB) would otherwise count as the first DeepSpeed row's peak memory.
    from pyparallel.bench.adapter import Hyper

    world = torch.distributed.get_world_size()
    tiny = torch.nn.Linear(8, 8)
    quiet = {**config(1, False, 1, world, Hyper()), "comms_logger": {"enabled": False}}
    engine, *_ = deepspeed.initialize(model=tiny, model_parameters=tiny.parameters(), config=quiet)
    engine.backward(engine(torch.ones(1, 8)).sum())
    engine.step()
    del engine


def unavailable() -> str | None:
    """Why the DeepSpeed rows cannot run here (``deepspeed`` does not import), or None."""
    _prefer_cpu_accelerator()
    try:
        importlib.import_module("deepspeed")
    except Exception as exc:  # noqa: BLE001 (an install broken in any way is a reason to skip, said as is)
        return f"deepspeed does not import ({type(exc).__name__}: {exc})".splitlines()[0]
    return None


def config(stage: int, offload: bool, micro_batch: int, dp: int, hp) -> dict:
    """The DeepSpeed configuration equivalent to our row (module doc)."""
    bf16 = hp.dtype == "bf16"
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    params = {"lr": hp.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": hp.weight_decay}
    if not offload:
        params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "train_batch_size": micro_batch * dp,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,  # no progress lines inside the timed steps
        "wall_clock_breakdown": False,
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False},
        # bf16: gradients reduced and accumulated in fp32, as our rows do (DeepSpeed's default would reduce
        # in the bf16 compute dtype).
        **({"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {}),
    }


# Bytes a rank sends per logged call, by the nccl-tests convention pyparallel/accounting.py uses. DeepSpeed's
# logger records the size of the call's ``tensor`` argument: the whole tensor for all-reduce and
# reduce-scatter, this rank's shard for all-gather.
def _sent_factor(op: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if op.startswith("all_reduce") or op == "inference_all_reduce":
        return 2.0 * (n - 1) / n
    if op.startswith("reduce_scatter"):
        return (n - 1) / n
    if op.startswith("all_gather") or op == "allgather_fn":
        return float(n - 1)
    if op in ("recv", "irecv", "barrier"):
        return 0.0
    return 1.0  # broadcast, reduce, send


class DeepSpeedZero(Adapter):
    """``deepspeed.initialize`` at the row's ZeRO stage over this mesh's data-parallel group (the world)."""

    def __init__(self, spec, mesh, cfg, hp, microbatches):
        super().__init__(spec, mesh, cfg, hp, microbatches)
        _, self.stage, self.offload = ROWS[spec.name]
        if mesh.dp != mesh.world_size:
            raise ValueError(f"{spec.name}: DeepSpeed's data-parallel group is the world here "
                             f"(dp={mesh.dp}, world={mesh.world_size})")
        preload(mesh.backend)  # a no-op after the worker's own call
        import deepspeed

        self.ds = deepspeed
        model = self.new_model()
        # The batch sizes only feed DeepSpeed's data loader and throughput prints, which the bench does not
        # use: gradients are averaged over the dp ranks whatever they say (one accumulation step).
        cfg = config(self.stage, self.offload, 1, mesh.dp, hp)
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=cfg)
        self.logging = True
        self.sent: list[int] = []
        self.by_op: dict[str, int] = {}

    def step(self, idx, tgt):
        idx, tgt = (dp_rows(t, self.mesh.dp, self.mesh.dp_rank) for t in (idx, tgt))
        dscomm = self.ds.comm
        if self.logging:
            dscomm.reset_log()
        loss = self.engine(idx, tgt)
        self.engine.backward(loss)
        self.engine.step()
        if self.logging:
            self._record(dscomm.comms_logger.comms_dict)
        return loss.item()

    def _record(self, comms: dict) -> None:
        n, sent = self.mesh.dp, 0
        for op, sizes in comms.items():
            b = sum(size * rec[0] for size, rec in sizes.items()) * _sent_factor(op, n)
            self.by_op[op] = int(round(b))
            sent += b
        self.sent.append(int(round(sent)))

    def timing_starts(self):
        self.logging = False  # the logger times (and on GPUs synchronises) every call: not in timed steps
        self.ds.comm.configure(enabled=False)

    def stats(self):
        inner = getattr(self.opt, "optimizer", self.opt)  # says which Adam really ran (CPU Adam with offload)
        out = {"optimizer": f"{type(self.opt).__name__}({type(inner).__module__}.{type(inner).__name__})"}
        if self.sent:  # steps logged: the warm-up steps (none with --warmup 0); the last is the steady state
            out.update(comm_bytes_per_step=self.sent[-1], comm_bytes_by_op=dict(self.by_op))
        return out

    def model_states(self):
        """Storage of every tensor the engine holds for the model: the module's parameters (under stage 3
        their partitions, ``ds_tensor``) and gradients, the tensors the ZeRO optimizer keeps (fp32
        partitions, gradient partitions and buckets), and the inner optimizer's state. Each storage once."""
        params = list(self.engine.module.parameters())
        parts = [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
        inner = getattr(self.opt, "optimizer", self.opt)
        out = count_model_states(params + parts, [inner])
        seen: set = set()
        counted = [*(p for p in params + parts), *(p.grad for p in params if p.grad is not None)]
        for st in inner.state.values():
            counted += [v for v in st.values() if isinstance(v, torch.Tensor)]
        _collect_keys(counted, seen)
        held = _held_tensors(self.opt)
        out["zero_buffers"] = _new_bytes(held, seen)
        out["total"] += out["zero_buffers"]
        return out


def _collect_keys(tensors, seen: set) -> None:
    for t in tensors:
        st = t.untyped_storage()
        seen.add((st.data_ptr(), t.device))


def _new_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if st.nbytes() and key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def _held_tensors(obj, depth: int = 3) -> list[torch.Tensor]:
    """Tensors reachable from ``obj``'s attributes through lists, tuples and dicts, ``depth`` levels deep
    (not through modules or other objects: those are the model, counted separately, or helpers)."""
    out: list[torch.Tensor] = []

    def walk(v, d):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif d > 0 and isinstance(v, (list, tuple)):
            for x in v:
                walk(x, d - 1)
        elif d > 0 and isinstance(v, dict):
            for x in v.values():
                walk(x, d - 1)

    for value in vars(obj).values():
        walk(value, depth)
    return out


def build(spec, mesh, cfg, hp, microbatches) -> Adapter:
    return DeepSpeedZero(spec, mesh, cfg, hp, microbatches)
