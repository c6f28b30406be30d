"""Peak memory per rank when a model is built on the meta device and read from a sharded safetensors folder
(issue 13, "Numbers to reach"), against one process training the same model from the same file.

* The model: the built-in GPT at GPT-2 small's width (768, 12 heads) with 16 layers and a 50304-token
  vocabulary (152.8M parameters; ``--layers 12`` is GPT-2 small's 124.5M),
  written once as a Hugging Face-style folder (``model-0000k-of-0000n.safetensors`` + index, the model's
  own names, the tied head stored once under ``embed.wte.weight``).
* ``single``: one process builds the model on the meta device, gives it storage and copies each tensor in
  from the folder (one shard file open at a time), then trains with torch's AdamW (fp32).
* ``zero3``: 4 ranks, ``zero.setup(meta model, mesh, stage=3, weights=folder)``: each rank reads only the
  slices of its shards. Same global batch, split over the ranks.
* ``tp`` (tp=2) and ``pp`` (pp=2, 1F1B, 2 micro-batches): ``pyparallel.parallelize(meta model, ...,
  weights=folder)``, run once parallelize accepts ``weights=`` (checked at run time; otherwise reported as
  not run, with the reason).

Memory is each process's peak resident set above its resident set right after ``import torch, pyparallel``
(every process is fresh; the baseline also holds the ~150 MB of Python meta kernels that torch imports the
first time a meta-device model is initialised, the same in every process whatever the model). The peak is
the kernel's high-water mark ``VmHWM`` of the process, not ``ru_maxrss``: on Linux ``ru_maxrss`` carries
the parent's peak over fork + exec (a child of an 800 MB parent reports 800 MB), while ``VmHWM`` belongs
to the process's own address space. glibc runs in the bench's precise mode (``pyparallel.bench.measure``):
every allocation of 64 KiB or more is its own mmap, so resident memory follows live tensors. Predicted:
the planner's per-rank peak for the same layout (``pyparallel.bench.predict.predict_rank``: model states
+ activations + communication buffers).

Loading speed, after the training steps, in the ZeRO-3 row's processes, alternating round by round: the 4
ranks each reading their quarter (the pieces their shards need, through ``checkpoint.weights.WeightsReader``)
all at once, the slowest rank counting; then rank 0 alone doing what one process does,
``safetensors.torch.load_file`` of every shard with each tensor copied out of the file mapping
(``load_file`` alone maps the files and reads nothing). Also the whole ``zero.setup(..., weights=)``. Files
are in the page cache (written just before; dropping caches needs privileges these machines do not give).

``--cgroup-demo``: give every process its own memory cgroup with the same limit (cgroup v2 ``memory.max``
or v1 ``memory.limit_in_bytes``, created under this process's own memory cgroup) between the single
process's peak and a ZeRO-3 rank's, then run both: the single process is killed by the kernel's OOM
killer, the 4 ranks train. The limit counts everything the process holds, the ~500 MB of ``import torch``
included.

    python benchmarks/memory.py --json benchmarks/out/memory.json [--cgroup-demo]

Targets: ZeRO-3 at 4 ranks <= 0.45x the single process's peak; TP and PP at 2 <= 0.6x; loading into 4
ranks <= 1.5x one process's ``load_file``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, table, write_json  # noqa: E402

MiB = 2**20
LR = 1e-4


# ------------------------------------------------------------------------------------------ the model


def model_config(args) -> dict:
    return dict(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, vocab_size=args.vocab,
                block_size=args.block)


def write_folder(cfg: dict, folder: str, shard_mb: float) -> dict:
    """The GPT (seeded init) as a Hugging Face-style sharded folder; reused when it holds this config."""
    from safetensors.torch import save_file

    from pyparallel.models.gpt import GPT, gpt_config

    stamp = os.path.join(folder, "pyparallel-bench.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            info = json.load(f)
        if info["config"] == cfg:
            return info
    os.makedirs(folder, exist_ok=True)
    for f in os.listdir(folder):
        if f.endswith(".safetensors") or f.endswith(".json"):
            os.remove(os.path.join(folder, f))
    model = GPT(gpt_config("tiny", **cfg), seed=0)
    named = [(n, p.detach()) for n, p in model.named_parameters()]  # the tied head once
    shards, cur, size = [], [], 0
    for n, p in named:
        if cur and size + p.nbytes > shard_mb * MiB:
            shards.append(cur)
            cur, size = [], 0
        cur.append((n, p))
        size += p.nbytes
    shards.append(cur)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: p.contiguous() for n, p in shard}, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update({n: name for n, _ in shard})
    total = sum(p.nbytes for _, p in named)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    info = {"config": cfg, "params": model.num_params(), "bytes": total, "shards": len(shards)}
    with open(stamp, "w") as f:
        json.dump(info, f)
    return info


def meta_gpt(cfg: dict):
    import torch

    from pyparallel.models.gpt import GPT, gpt_config

    with torch.device("meta"):
        return GPT(gpt_config("tiny", **cfg))


def shard_files(folder: str) -> list[str]:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return [os.path.join(folder, s) for s in sorted(set(json.load(f)["weight_map"].values()))]


# ------------------------------------------------------------------------------------------------ rows


def build_single(cfg, folder, batch):
    """The plain model from the folder, one shard file open at a time, and torch's AdamW."""
    import torch
    from safetensors import safe_open

    from pyparallel import materialize

    model = meta_gpt(cfg)
    materialize.empty_params(model, torch.device("cpu"))
    materialize.rebuild_buffers(model, torch.device("cpu"), loadable={n for n, _ in model.named_parameters()})
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file in shard_files(folder):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    params[key].copy_(f.get_tensor(key))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(idx, tgt):
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, model, opt, None


def build_zero3(cfg, folder, batch):
    import pyparallel
    from pyparallel import comm, zero

    mesh = pyparallel.init()
    comm.barrier(mesh.world_group)
    t0 = time.perf_counter()  # the load proper: from the meta model to the trainable shards
    model, opt = zero.setup(meta_gpt(cfg), mesh, stage=3, lr=LR, weights=folder)
    model.setup_s = time.perf_counter() - t0
    share = batch // mesh.dp
    rows = slice(mesh.dp_rank * share, (mesh.dp_rank + 1) * share)

    def step(idx, tgt):
        loss = model(idx[rows], tgt[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step, model, opt, mesh


def _build_parallelize(tp: int, pp: int):
    def build(cfg, folder, batch):
        import pyparallel

        mesh = pyparallel.init(tp=tp, pp=pp)
        pm = pyparallel.parallelize(meta_gpt(cfg), mesh, weights=folder, lr=LR, num_microbatches=2 if pp > 1 else None)
        rows = pm.batch_slice(batch)
        return (lambda idx, tgt: pm.step(idx[rows], tgt[rows])), pm, pm.optimizer, mesh

    return build


def parallelize_takes_weights() -> str | None:
    import inspect

    import pyparallel

    if "weights" in inspect.signature(pyparallel.parallelize).parameters:
        return None
    return "pyparallel.parallelize has no weights= yet"


@dataclass(frozen=True)
class Row:
    """One layout: how many processes, how each builds its model from the folder, the target ratio, the
    bench's StrategySpec fields for the planner's prediction, and why it cannot run (None: it can)."""

    name: str
    world: int
    build: object
    target: float | None
    spec: dict
    unavailable: object = None


ROWS = {
    "single": Row("single", 1, build_single, None, dict(name="single")),
    "zero3": Row("zero3", 4, build_zero3, 0.45, dict(name="zero3", dp=4, zero=3)),
    "tp": Row("tp", 2, _build_parallelize(2, 1), 0.6, dict(name="tp", tp=2), parallelize_takes_weights),
    "pp": Row("pp", 2, _build_parallelize(1, 2), 0.6, dict(name="pp-1f1b", pp=2), parallelize_takes_weights),
}


# ------------------------------------------------------------------------------------------ the worker


def worker(a) -> None:
    """One process of a row: peak resident memory above the start, losses, load time, model states."""
    import torch

    from pyparallel import comm
    from pyparallel import memory as pmemory
    from pyparallel.bench import measure

    torch.set_num_threads(1)
    measure.precise_mode()
    # A meta-device randn with a generator (the GPT's own init, run when it is built on meta) makes torch
    # import its Python meta kernels once: ~900 modules (sympy among them), ~150 MB, the same in every
    # process whatever the model's size. Part of importing torch, so paid before the baseline.
    with torch.device("meta"):
        torch.randn(2, generator=torch.Generator())
    peak = measure.PeakMemory(torch.device("cpu"))
    peak.baseline()  # right after import torch / pyparallel: what every process pays before any model
    peak.start()
    cfg, row = json.loads(a.config), ROWS[a.worker]
    from pyparallel.models.gpt import gpt_config, synthetic_batch

    gcfg = gpt_config("tiny", **cfg)
    data = [synthetic_batch(gcfg, a.batch, a.seq, seed=s) for s in range(a.steps)]
    t0 = time.perf_counter()
    step, model, opt, mesh = row.build(cfg, a.folder, a.batch)
    build_s = time.perf_counter() - t0
    out = {"rank": int(os.environ.get("RANK", "0")), "base_rss": peak.base, "build_s": build_s,
           "setup_s": getattr(model, "setup_s", None)}
    out["load_peak_bytes"] = measure._status_kib("VmHWM") * 1024 - peak.base
    out["losses"] = [step(idx, tgt) for idx, tgt in data]
    out["peak_bytes"] = peak.peak_bytes()  # before the loading race, which rank 0 joins holding the whole model
    out["states"] = pmemory.model_state_bytes(model, opt)["model_states"]
    if a.worker == "zero3" and a.repeats:
        out["read_s"], out["load_file_s"], out["load_file_mapped_s"] = loading_race(model, mesh, cfg, a.folder,
                                                                                    a.repeats)
    if mesh is not None and mesh.world_size > 1:
        comm.barrier(mesh.world_group)
    with open(a.out, "w") as f:
        json.dump(out, f)


def loading_race(model, mesh, cfg, folder, repeats: int):
    """Alternately, ``repeats`` times: every rank reads its ZeRO-3 pieces from the folder at once (what
    ``zero.setup(weights=)`` reads, without building the engine; the slowest rank counts), then rank 0 alone
    loads the whole folder as one process would while the others wait. Alternating in one run keeps the
    load of a shared machine from favouring either side. Returns this rank's read times and rank 0's
    ``load_file`` times (with the copy, and mapping only)."""
    import torch

    from pyparallel import comm
    from pyparallel.checkpoint.weights import WeightsReader, expected_of

    pieces = [(p, v) for p, v in model.checkpoint_pieces() if p.name.startswith("model/")]
    aliases = expected_of(meta_gpt(cfg))[1]
    reads, whole, mapped = [], [], []
    for _ in range(repeats):
        comm.barrier(mesh.world_group)
        t0 = time.perf_counter()
        reader = WeightsReader(folder)
        reader.resolve_aliases(aliases)
        with torch.no_grad():
            for piece, view in pieces:
                view.copy_(reader.piece(piece))  # the values it already holds: training is unchanged
        del reader
        reads.append(time.perf_counter() - t0)
        comm.barrier(mesh.world_group)
        if mesh.rank == 0:
            m, c = load_whole(folder)
            mapped.append(m)
            whole.append(c)
        comm.barrier(mesh.world_group)
    return reads, whole, mapped


def load_whole(folder: str) -> tuple[float, float]:
    """One process's load: ``safetensors.torch.load_file`` of every shard, then every tensor copied into a
    tensor of its own. ``load_file`` alone only maps the files (safetensors returns tensors over the
    mapping: 583 MB "load" in ~0.015 s) and the bytes are read at the first touch, so the figure compared
    includes the copy. Returns seconds (mapping only, with the copy)."""
    import torch
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    tensors = {}
    for file in shard_files(folder):
        tensors.update(load_file(file))
    t1 = time.perf_counter()
    owned = {k: torch.empty_like(v).copy_(v) for k, v in tensors.items()}
    t2 = time.perf_counter()
    del tensors, owned
    return t1 - t0, t2 - t0


# ------------------------------------------------------------------------------------------ cgroups


class MemoryCgroups:
    """Per-process memory limits in child cgroups of this process's own memory cgroup: cgroup v2
    (``memory.max``, ``memory.events`` oom_kill) when the memory controller is enabled there, else the v1
    memory hierarchy (``memory.limit_in_bytes``, ``memory.oom_control``). ``problem`` says why neither
    works (not mounted, not writable), else None."""

    def __init__(self):
        self.version, self.base, self.problem = None, None, None
        lines = open("/proc/self/cgroup").read().splitlines()
        v1 = next((ln.split(":", 2)[2] for ln in lines if ln.split(":")[1] == "memory"), None)
        v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
        for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
            ctl = os.path.join(mount, v2.lstrip("/") if v2 else "", "cgroup.subtree_control")
            if v2 is not None and os.path.exists(ctl) and "memory" in open(ctl).read().split():
                self.version, self.base = 2, os.path.dirname(ctl)
                break
        if self.version is None and v1 is not None and os.path.isdir("/sys/fs/cgroup/memory"):
            self.version, self.base = 1, os.path.join("/sys/fs/cgroup/memory", v1.lstrip("/"))
        if self.version is None:
            self.problem = ("no memory controller: cgroup v2 does not delegate 'memory' to this cgroup and no v1 "
                            "memory hierarchy is mounted")
            return
        try:
            probe = self.create("probe", 2**30)
            self.remove(probe)
        except OSError as exc:
            self.problem = f"cannot create a memory cgroup under {self.base} (v{self.version}): {exc}"

    def create(self, name: str, limit: int) -> str:
        path = os.path.join(self.base, f"pyparallel-memdemo-{os.getpid()}-{name}")
        os.makedirs(path, exist_ok=True)
        knob = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        with open(os.path.join(path, knob), "w") as f:
            f.write(str(int(limit)))
        return path

    def join(self, path: str):
        """A preexec_fn: the child enters the cgroup before it execs (so the limit covers its imports too)."""
        def enter():
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        return enter

    def oom_kills(self, path: str) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in open(os.path.join(path, name)).read().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def peak(self, path: str) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        p = os.path.join(path, name)
        return int(open(p).read()) if os.path.exists(p) else None

    def remove(self, path: str) -> None:
        for _ in range(50):
            try:
                os.rmdir(path)
                return
            except OSError:
                time.sleep(0.1)  # the last process of the group is still being reaped


# ------------------------------------------------------------------------------------------ the driver


def spawn(row: str, world: int, a, tmp: str, cgroups: MemoryCgroups | None = None, limit: int | None = None,
          timeout_s: float = 1200, repeats: int | None = None) -> dict:
    """Run ``world`` fresh worker processes of ``row``; every rank's result, or how the run failed."""
    from pyparallel.launch import free_port

    port = free_port()
    procs, outs, groups = [], [], []
    for r in range(world):
        out = os.path.join(tmp, f"{row}-{r}-{time.monotonic_ns()}.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", row, "--out", out, "--folder", a.folder,
               "--config", json.dumps(model_config(a)), "--batch", str(a.batch), "--seq", str(a.seq),
               "--steps", str(a.steps), "--repeats", str(a.repeats if repeats is None else repeats)]
        pre = None
        if cgroups is not None:
            groups.append(cgroups.create(f"{row}-{r}", limit))
            pre = cgroups.join(groups[-1])
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=pre, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    deadline = time.monotonic() + timeout_s
    failed = None
    while any(p.poll() is None for p in procs):
        bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad and failed is None:
            failed = (bad[0], time.monotonic())
        if time.monotonic() > deadline or (failed and time.monotonic() > failed[1] + 10):
            for p in procs:  # peers of a dead rank wait in a collective that will not come
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        time.sleep(0.2)
    result = {"row": row, "world": world, "codes": [p.returncode for p in procs]}
    if cgroups is not None:
        result["oom_kills"] = [cgroups.oom_kills(g) for g in groups]
        result["cgroup_peak"] = [cgroups.peak(g) for g in groups]
        for g in groups:
            cgroups.remove(g)
    if all(c == 0 for c in result["codes"]):
        result["ranks"] = [json.load(open(o)) for o in outs]
    else:
        result["stderr"] = [p.stderr.read()[-1500:] for p in procs]
    return result


def predicted_peak(row: Row, cfg: dict, batch: int, seq: int) -> int | None:
    from pyparallel.bench.predict import predict_rank
    from pyparallel.bench.specs import StrategySpec
    from pyparallel.models.gpt import gpt_config

    spec = StrategySpec(**row.spec)
    stages = range(spec.pp)
    return max(predict_rank(spec, gpt_config("tiny", **cfg), batch, seq, 2, s, on_cpu=True)["peak_bytes"]
               for s in stages)


def measure_rows(a, tmp: str) -> tuple[list[dict], dict]:
    cfg = model_config(a)
    runs, table_rows = {}, []
    for name in a.rows:
        row = ROWS[name]
        reason = row.unavailable() if row.unavailable else None
        if reason:
            table_rows.append({"row": name, "world": row.world, "note": f"not run: {reason}"})
            continue
        print(f"running {name} on {row.world} process(es) ...", flush=True)
        run = runs[name] = spawn(name, row.world, a, tmp)
        if "ranks" not in run:
            table_rows.append({"row": name, "world": row.world, "note": f"failed: codes {run['codes']}"})
            print("\n".join(run["stderr"]), file=sys.stderr)
            continue
        peak = max(r["peak_bytes"] for r in run["ranks"])
        ranks = sorted(run["ranks"], key=lambda r: r["rank"])
        table_rows.append({"row": name, "world": row.world, "peak_MiB": peak / MiB,
                           "rank_peaks_MiB": [round(r["peak_bytes"] / MiB, 1) for r in ranks],
                           "load_peak_MiB": max(r["load_peak_bytes"] for r in run["ranks"]) / MiB,
                           "states_MiB": max(r["states"] for r in run["ranks"]) / MiB,
                           "predicted_MiB": predicted_peak(row, cfg, a.batch, a.seq) / MiB,
                           "base_rss_MiB": max(r["base_rss"] for r in run["ranks"]) / MiB,
                           "target": row.target, "losses": run["ranks"][0]["losses"]})
    single = next((r for r in table_rows if r["row"] == "single" and "peak_MiB" in r), None)
    for r in table_rows:
        if single and "peak_MiB" in r:
            r["ratio"] = r["peak_MiB"] / single["peak_MiB"]
            r["met"] = None if r["target"] is None else ("yes" if r["ratio"] <= r["target"] else "NO")
    return table_rows, runs


def loading(runs: dict, repeats: int) -> dict:
    z = runs.get("zero3")
    if not (z and "ranks" in z and repeats):
        return {}
    ranks = z["ranks"]
    reads = [max(r["read_s"][i] for r in ranks) for i in range(repeats)]  # the slowest rank, per round
    out = {"load_file_s": median(ranks[0]["load_file_s"]),
           "load_file_mapped_only_s": median(ranks[0]["load_file_mapped_s"]),
           "zero3_read_s": median(reads), "zero3_setup_s": max(r["setup_s"] for r in ranks)}
    out["ratio_read"] = out["zero3_read_s"] / out["load_file_s"]
    out["ratio_read_per_round"] = [r / w for r, w in zip(reads, ranks[0]["load_file_s"])]
    out["ratio_setup"] = out["zero3_setup_s"] / out["load_file_s"]
    return out


def cgroup_demo(a, tmp: str, rows: list[dict]) -> dict:
    groups = MemoryCgroups()
    if groups.problem:
        return {"note": groups.problem}
    by = {r["row"]: r for r in rows}
    if a.limit_mb:
        limit = int(a.limit_mb * MiB)
    elif "peak_MiB" in by.get("single", {}) and "peak_MiB" in by.get("zero3", {}):
        # halfway between what a ZeRO-3 rank and the single process hold in all (imports included)
        single = by["single"]["peak_MiB"] + by["single"]["base_rss_MiB"]
        rank = by["zero3"]["peak_MiB"] + by["zero3"]["base_rss_MiB"]
        limit = int((single + rank) / 2 * MiB)
    else:
        return {"note": "needs the single and zero3 rows measured first, or --limit-mb"}
    print(f"cgroup demo: every process limited to {limit / MiB:.0f} MiB (cgroup v{groups.version}) ...", flush=True)
    single = spawn("single", 1, a, tmp, groups, limit, repeats=0)
    zero3 = spawn("zero3", 4, a, tmp, groups, limit, repeats=0)  # no loading race: rank 0 would load everything
    return {"cgroup_version": groups.version, "limit_MiB": limit / MiB,
            "single": {"codes": single["codes"], "oom_kills": single["oom_kills"],
                       "cgroup_peak_MiB": [p / MiB if p else None for p in single["cgroup_peak"]]},
            "zero3": {"codes": zero3["codes"], "oom_kills": zero3["oom_kills"],
                      "cgroup_peak_MiB": [p / MiB if p else None for p in zero3["cgroup_peak"]],
                      "losses": zero3["ranks"][0]["losses"] if "ranks" in zero3 else None}}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="16: 152.8M parameters; 12 is GPT-2 small (124.5M)")
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="global batch (split over data-parallel ranks)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="rounds of the loading race (0: none)")
    p.add_argument("--rows", default="single,zero3,tp,pp")
    p.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "pyparallel-memory-bench"))
    p.add_argument("--shard-mb", type=float, default=200.0)
    p.add_argument("--cgroup-demo", action="store_true")
    p.add_argument("--limit-mb", type=float, default=None, help="the demo's per-process limit (default: halfway)")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.rows = [r for r in a.rows.split(",") if r]
    unknown = [r for r in a.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    return a


def run(a) -> dict:
    """Everything the command line does; returns the JSON payload (tests call it on a small model)."""
    info = write_folder(model_config(a), a.folder, a.shard_mb)
    with tempfile.TemporaryDirectory(prefix="pp-memory-") as tmp:
        rows, runs = measure_rows(a, tmp)
        load = loading(runs, a.repeats)
        demo = cgroup_demo(a, tmp, rows) if a.cgroup_demo else None
    return {"model": info, "batch": a.batch, "seq": a.seq, "steps": a.steps, "rows": rows, "loading": load,
            "cgroup_demo": demo}


def main(argv=None) -> None:
    a = parse(argv)
    if a.worker:
        return worker(a)
    payload = run(a)
    m = payload["model"]
    print(f"\nGPT {m['config']}: {m['params']:,} parameters, {m['bytes'] / MiB:.0f} MiB in {m['shards']} shards; "
          f"global batch {a.batch} x seq {a.seq}, {a.steps} AdamW steps, fp32")
    print(table(payload["rows"], ["row", "world", "peak_MiB", "ratio", "target", "met", "predicted_MiB",
                                  "states_MiB", "load_peak_MiB", "base_rss_MiB", "note"]))
    if payload["loading"]:
        print("\nloading:", json.dumps(payload["loading"], indent=1))
    if payload["cgroup_demo"] is not None:
        print("\ncgroup demo:", json.dumps(payload["cgroup_demo"], indent=1))
    write_json(a.json, payload)


if __name__ == "__main__":
    main()
