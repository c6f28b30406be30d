"""The GPU check: every CUDA path of pyparallel in one run on one lent GPU (issue 18, part 4).

``benchmarks/gpu_check.sh`` runs each step below in a process of its own under ``timeout`` (so a hang or a
crash in one step cannot stop the others); after each step benchmarks/gpu_check_report.py merges what the
steps wrote into ``$OUT/gpu_check.json`` and ``$OUT/gpu_check.md`` (a table ready for benchmarks/RESULTS.md).

    python benchmarks/gpu_check.py --list                       # steps and their budgets, then the total
    python benchmarks/gpu_check.py --step adam --work DIR       # one step -> DIR/steps/adam.json
    bash benchmarks/gpu_check.sh --dry-run                      # every step's CPU part, here

A step writes its record when its CPU part is done and again at its end, so one killed in its CUDA part
keeps its CPU part. A part that finds a wrong result carries an ``error`` (the step fails) and keeps its
figures, so the table survives a mismatch.

Every step has a CPU part (the same code on small sizes: the kernels' CPU twins, the copy engine's worker
thread, gloo) and a CUDA part. ``--dry-run`` runs the CPU parts and records each CUDA part as "not run",
so the script's own logic is tested on machines without a GPU (tests/test_gpu_check.py).

The budget (seconds on one H100/H200, 16 cores; the sum stays well under 8 minutes) is written beside each
step in STEPS: the sizes are chosen to fit it. Benchmarks may call torch.cuda directly (DESIGN.md keeps that to
pyparallel/device.py inside the library).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.machinery
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402  (before pyparallel._C, which links against it)

NOT_RUN = "not run"
ADAM_NUMEL = 1_000_000_000  # "1B parameters", in ADAM_TENSORS tensors as a model would hold them
ADAM_TENSORS = 128
COPY_BYTES = 1 << 30  # the copy-bandwidth and offload transfers: 1 GiB
EXT_DIR = ROOT / "pyparallel"  # where an in-place build puts _C*.so (a module global: the tests point it away)
PROBE_RESERVE_S = 25  # of the build's budget, kept for the probe: a fresh interpreter importing torch and _C
LAUNCH_MARGIN_S = 5  # of a step's time left, kept from pyparallel.launch to stop its worker and write the record

# The running step's scratch folder, deadline (epoch seconds) and record: run_step sets them.
WORK = Path(os.environ.get("GPU_CHECK_WORK", "benchmarks/out/gpu"))
DEADLINE: float | None = None
_REC: dict | None = None


def time_left(margin: float = 0.0) -> float:
    """Seconds until the running step's deadline, less ``margin``."""
    return (DEADLINE if DEADLINE is not None else time.time() + 3600) - time.time() - margin


def _save_record() -> None:
    (WORK / "steps").mkdir(parents=True, exist_ok=True)
    (WORK / "steps" / f"{_REC['step']}.json").write_text(json.dumps(_REC, indent=2, default=str))


def save_part(where: str, part) -> None:
    """Write one finished part (``cpu``) into the running step's record now: if the CUDA part after it hangs
    and the step is killed, the report still has the CPU part."""
    if _REC is not None:
        _REC[where] = part
        _save_record()


def dev_of(dry: bool) -> torch.device:
    return torch.device("cpu") if dry else torch.device("cuda")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_ms(fn, dev: torch.device, iters: int, warmup: int = 1) -> float:
    """Median wall milliseconds of ``fn()`` with the device drained before and after each call."""
    out = []
    for i in range(warmup + iters):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------- env and build


def step_env(dry: bool, budget_s: float) -> dict:
    """Versions: python, torch, CUDA, the device, nvcc (the report's header). 5 s per tool: the budget is 10."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=5).stdout
        lines = nvcc.strip().splitlines()  # "Cuda compilation tools, release 13.0, V13.0.88" says the version
        out["nvcc"] = next((x for x in lines if "release" in x), lines[-1] if lines else None)
    except (OSError, subprocess.SubprocessError) as exc:
        out["nvcc"] = f"unavailable ({exc})"
    cuda = NOT_RUN
    if not dry:
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            smi = f"unavailable ({exc})"
        props = torch.cuda.get_device_properties(0)
        cuda = {"device": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "nvidia_smi": smi.strip()}
    return {"cpu": out, "cuda": cuda}


def _kernels() -> dict:
    """What the built extension registered (a fresh process would see the same)."""
    from pyparallel import _ops

    info = {"extension": _ops.HAS_EXT, "error": _ops._EXT_ERROR}
    if _ops.HAS_EXT:
        info["with_cuda"] = bool(getattr(_ops._C, "with_cuda", False))
        for op in ("adam_step", "gelu_linear", "gelu_linear_backward", "flatten_into", "unflatten_from"):
            for key in ("CPU", "CUDA"):
                try:
                    info[f"{op}:{key}"] = torch._C._dispatch_has_kernel_for_dispatch_key(f"pyparallel::{op}", key)
                except RuntimeError:
                    info[f"{op}:{key}"] = False
    return info


def _run_logged(cmd: list, env: dict, timeout_s: float, log: Path) -> int:
    """Run ``cmd`` with its output appended to ``log``; 124 when it runs past ``timeout_s``. It gets a
    session of its own, and a timeout (ours, or the driver's SIGTERM to this step) kills that whole
    process group: killing setup.py, pip or pytest alone leaves ninja, nvcc or test workers running
    into the next steps."""
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(map(str, cmd))}  (timeout {timeout_s:.0f} s)\n".encode())
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

        def on_term(signum, frame):
            os.killpg(p.pid, signal.SIGKILL)
            sys.exit(124)

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            return p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            f.write(f"\n[gpu_check] timed out after {timeout_s:.0f} s; process group killed\n".encode())
            return 124
        finally:
            signal.signal(signal.SIGTERM, previous)


def _built_libraries() -> list[str]:
    # The names pyparallel/_jit.py looks for beside _ops.py: with none there, importing the ops would start
    # the compile-on-first-use (minutes) instead of failing.
    return sorted(p.name for s in importlib.machinery.EXTENSION_SUFFIXES for p in EXT_DIR.glob("_C" + s))


def step_build(dry: bool, budget_s: float) -> dict:
    """An in-place build with the CUDA kernels for this GPU (all the steps need: they import pyparallel from
    this checkout), falling back to pip's editable install; then a fresh interpreter says which kernels the
    library registered. The dry run builds nothing (it must not replace the extension other people are
    using) and reports what the present one registered."""
    if dry:
        return {"cpu": _kernels(), "cuda": NOT_RUN}
    env = dict(os.environ, PYPARALLEL_CUDA="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
    env.pop("PYPARALLEL_NO_EXT", None)  # setup.py builds nothing with it set, and the probe would load nothing
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    log = WORK / "build_compile.log"  # not build.log: the driver writes this step's own output there
    attempts = []
    # --no-deps: no network there, and the runtime dependencies do not matter for these checks.
    for cmd in ([sys.executable, "setup.py", "build_ext", "--inplace"],
                [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."]):
        left = time_left(PROBE_RESERVE_S)
        if left < 20:
            break
        t0 = time.perf_counter()
        rc = _run_logged(cmd, env, left, log)
        attempts.append({"cmd": " ".join(cmd[1:]), "rc": rc, "s": round(time.perf_counter() - t0, 1)})
        if rc == 0:
            break
    libs = _built_libraries()
    if not libs:
        kernels = {"error": f"no _C library in {EXT_DIR} after the build"}
    else:
        try:
            probe = subprocess.run([sys.executable, __file__, "--kernels"], cwd=ROOT, env=env, capture_output=True,
                                   text=True, timeout=max(time_left(3), 5))
            kernels = (json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0
                       else {"error": probe.stderr[-2000:]})
        except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
            kernels = {"error": f"probe: {type(exc).__name__}: {exc}"}
    kernels["libraries"] = libs
    part = {"attempts": attempts, "kernels": kernels}
    if not (any(a["rc"] == 0 for a in attempts) and kernels.get("with_cuda") and kernels.get("adam_step:CUDA")
            and kernels.get("gelu_linear:CUDA")):
        text = log.read_text(errors="replace") if log.exists() else ""
        part["error"] = f"build failed or has no CUDA kernels: attempts {attempts}, kernels {kernels}"
        part["log_tail"] = text[-3000:]
        print(text[-3000:], file=sys.stderr)  # into the step's log and the combined one
    return {"cpu": NOT_RUN, "cuda": part}


def step_tests(dry: bool, budget_s: float) -> dict:
    """The repository's CUDA tests (``pytest -k cuda``; they skip without a GPU). Dry run: collect them."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-k", "cuda", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "-rfEs", "tests"]
    if dry:
        cmd.insert(3, "--collect-only")
    log = WORK / "tests_pytest.log"
    rc = _run_logged(cmd, dict(os.environ), max(time_left(5), 10), log)
    tail = log.read_text(errors="replace").strip().splitlines()[-25:]
    part = {"rc": rc, "summary": tail[-1] if tail else "", "tail": tail}
    if dry:
        return {"cpu": part, "cuda": NOT_RUN}
    if rc != 0:
        part["error"] = f"CUDA tests failed (exit {rc}): {part['summary']}"
    return {"cpu": NOT_RUN, "cuda": part}


# ---------------------------------------------------------------------------------------------- Adam


def copy_bandwidth(dev: torch.device, nbytes: int, iters: int = 5) -> float:
    """Device memory bandwidth as one large copy sees it: bytes read + written per second (GB/s)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    return gbps(2 * nbytes, median_ms(lambda: dst.copy_(src), dev, iters))


def _adam_tensors(numel: int, count: int, dtype, dev, seed: int):
    gen = torch.Generator(device=dev).manual_seed(seed)
    sizes = [numel // count + (1 if i < numel % count else 0) for i in range(count)]
    params = [torch.randn(n, device=dev, generator=gen).to(dtype) for n in sizes]
    grads = [torch.randn(n, device=dev, generator=gen).to(dtype) for n in sizes]
    return params, grads


def _max_diff(a: list, b: list) -> tuple[float, float]:
    """Max absolute difference, and max difference relative to max(|b|, 1e-3)."""
    abs_d = rel_d = 0.0
    for x, y in zip(a, b):
        x, y = x.detach().float(), y.detach().float()  # params: no autograd graph for a check
        d = (x - y).abs()
        abs_d = max(abs_d, float(d.max()))
        rel_d = max(rel_d, float((d / y.abs().clamp_min(1e-3)).max()))
    return abs_d, rel_d


HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def adam_case(dev: torch.device, numel: int, count: int, dtype, steps: int, iters: int) -> dict:
    """pyparallel's FusedAdam against torch.optim.AdamW(fused=True) on the same params and grads.

    fp32: both update fp32 params; after ``steps`` steps they must agree to fp32 rounding (rtol 1e-5).
    bf16: ours keeps fp32 moments for bf16 params (the ZeRO compute copy); the reference is torch's fused
    AdamW on an fp32 copy, rounded to bf16 after one step: they must agree to one bf16 rounding. Speed is
    then measured for each on its own state: bytes moved per step over the median step time.
    """
    from pyparallel.optim import FusedAdam

    params, grads = _adam_tensors(numel, count, dtype, dev, seed=0)
    ref = [p.detach().float().clone() for p in params]
    ours = [torch.nn.Parameter(p) for p in params]
    theirs = [torch.nn.Parameter(p) for p in ref]
    for o, t, g in zip(ours, theirs, grads):
        o.grad, t.grad = g, g.float() if dtype != torch.float32 else g
    opt_o = FusedAdam(ours, adamw=True, **HP)
    opt_t = torch.optim.AdamW(theirs, fused=True, **HP)
    n_check = steps if dtype == torch.float32 else 1
    for _ in range(n_check):
        opt_o.step()
        opt_t.step()
    sync(dev)
    abs_d, rel_d = _max_diff(ours, [t.detach().to(dtype) for t in theirs] if dtype != torch.float32 else theirs)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7  # fp32 rounding; one bf16 rounding (8 bits)
    equal = rel_d <= tol
    ms_o = median_ms(opt_o.step, dev, iters)
    del opt_t, theirs, ref
    # torch's own fused path on params of this dtype (bf16 moments for bf16 params, as it keeps them)
    native = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, g in zip(native, grads):
        p.grad = g
    opt_n = torch.optim.AdamW(native, fused=True, **HP)
    ms_t = median_ms(opt_n.step, dev, iters)
    e = torch.empty((), dtype=dtype).element_size()
    # per element: param read+write, grad read, two moments read+write (ours fp32, torch's in param dtype)
    bytes_o = numel * (2 * e + e + 4 * 4)
    bytes_t = numel * (2 * e + e + 4 * e)
    del opt_n, native, opt_o, ours, params, grads
    return {"dtype": str(dtype).split(".")[-1], "numel": numel, "tensors": count, "max_abs_diff": abs_d,
            "max_rel_diff": rel_d, "tolerance": tol, "equal": equal, "checked_steps": n_check,
            "ours_ms": ms_o, "torch_fused_ms": ms_t, "ours_GBps": gbps(bytes_o, ms_o),
            "torch_fused_GBps": gbps(bytes_t, ms_t), "ours_over_torch_time": ms_o / ms_t}


def step_adam(dry: bool, budget_s: float) -> dict:
    """CUDA multi-tensor Adam vs torch.optim.AdamW(fused=True) on 1B params, fp32 and bf16 (~16 s on an
    H200: 28 GB of fp32 state per optimizer, ~10 ms per step at 4 TB/s). CPU part: the same on 1M."""
    from pyparallel import _ops

    def run(dev, numel, count, iters):
        kernel = _ops.has_kernel("adam_step", dev)
        if dev.type == "cuda" and not kernel:  # FusedAdam would time torch's reference and call it ours
            return {"kernel": False, "rows": [], "error": "no CUDA adam_step kernel "
                    f"({_ops._EXT_ERROR or 'the extension was built without CUDA'})"}
        bw = copy_bandwidth(dev, min(COPY_BYTES, numel * 4))
        rows = []
        for dtype in (torch.float32, torch.bfloat16):
            if dev.type == "cpu" and dtype != torch.float32:
                continue  # bf16 params are a CUDA-kernel feature (FusedAdam's CPU kernel takes fp32)
            row = adam_case(dev, numel, count, dtype, steps=3, iters=iters)
            row["ours_of_copy_bw"] = row["ours_GBps"] / bw
            row["torch_of_copy_bw"] = row["torch_fused_GBps"] / bw
            rows.append(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        part = {"kernel": kernel, "copy_GBps": bw, "rows": rows}
        bad = [r["dtype"] for r in rows if not r["equal"]]
        if bad:
            part["error"] = f"FusedAdam differs from torch.optim.AdamW(fused=True) in {bad}"
        return part

    cpu = run(torch.device("cpu"), 1 << 20, 8, 3)
    save_part("cpu", cpu)
    return {"cpu": cpu, "cuda": NOT_RUN if dry else run(torch.device("cuda"), ADAM_NUMEL, ADAM_TENSORS, 5)}


# ------------------------------------------------------------------------------------------- offload


def offload_copies(dev: torch.device, nbytes: int, iters: int) -> dict:
    """The offload copy engine (pinned host buffers, side stream) host->device and device->host, against
    ``tensor.to(non_blocking=True)`` from/to pinned memory as torch users write it, and a pageable copy."""
    from pyparallel import _ops

    if not _ops.HAS_EXT:
        raise RuntimeError(f"the copy engine is in the extension, which did not load: {_ops._EXT_ERROR}")
    n = nbytes // 4
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())  # the engine's stream belongs to one device
    engine = _ops._C.OffloadCopyEngine(dev, dev.type == "cuda")
    host = engine.alloc(n, torch.float32, "gpu_check buffer")
    host.uniform_()
    devt = torch.empty(n, device=dev)

    def via_engine(dst, src):
        engine.wait(engine.copy(dst, src))

    out = {"bytes": nbytes, "pinned": engine.pinned, "uses_cuda": engine.uses_cuda,
           "engine_h2d_GBps": gbps(nbytes, median_ms(lambda: via_engine(devt, host), dev, iters)),
           "engine_d2h_GBps": gbps(nbytes, median_ms(lambda: via_engine(host, devt), dev, iters))}
    torch.testing.assert_close(devt, host.to(dev))  # the copy moved the right bytes
    if dev.type == "cuda":
        pinned = torch.empty(n, pin_memory=True).uniform_()
        pageable = torch.empty(n).uniform_()
        out["to_h2d_GBps"] = gbps(nbytes, median_ms(lambda: pinned.to(dev, non_blocking=True), dev, iters))
        out["to_d2h_GBps"] = gbps(nbytes, median_ms(lambda: devt.to("cpu", non_blocking=True), dev, iters))
        out["copy_into_pinned_d2h_GBps"] = gbps(nbytes, median_ms(lambda: pinned.copy_(devt, non_blocking=True),
                                                                  dev, iters))
        out["pageable_h2d_GBps"] = gbps(nbytes, median_ms(lambda: pageable.to(dev), dev, iters))
        out["engine_over_to_h2d"] = out["engine_h2d_GBps"] / out["to_h2d_GBps"]
        out["engine_over_to_d2h"] = out["engine_d2h_GBps"] / out["to_d2h_GBps"]
        del pinned, pageable
    return out


def step_offload(dry: bool, budget_s: float) -> dict:
    """Pinned H2D/D2H through the copy engine vs tensor.to(non_blocking=True), 1 GiB, 5 times each (~5 s
    on PCIe 5). CPU part: the engine's worker-thread backend on 16 MiB."""
    cpu = offload_copies(torch.device("cpu"), 16 << 20, 3)
    save_part("cpu", cpu)
    return {"cpu": cpu, "cuda": NOT_RUN if dry else offload_copies(torch.device("cuda"), COPY_BYTES, 5)}


# ------------------------------------------------------------------------- ZeRO-Offload and wrappers
# These need a process group: each runs in one process started by pyparallel.launch (world size 1).


def _zero_offload_body(dry: bool, preset: str, batch: int, seq: int, steps: int) -> dict:
    import pyparallel
    from pyparallel import zero
    from pyparallel.models.gpt import GPT, gpt_config, synthetic_batch
    from pyparallel.optim import CPUAdam

    mesh = pyparallel.init(backend="gloo" if dry else "nccl")
    dev = mesh.device
    cfg = gpt_config(preset)
    data = [tuple(t.to(dev) for t in synthetic_batch(cfg, batch, seq, seed=s)) for s in range(steps)]
    dtype = None if dry else torch.bfloat16  # ZeRO-Offload's setting: bf16 on the GPU, fp32 on the host
    out = {"model": preset, "batch": batch, "seq": seq}
    losses = {}
    for offload in (False, True):
        fresh = GPT(cfg, seed=0)
        out["params"] = fresh.num_params()
        model, opt = zero.setup(fresh.to(dev), mesh, stage=2, optimizer=torch.optim.AdamW, lr=1e-4,
                                weight_decay=0.01, param_dtype=dtype, offload_optimizer=offload)
        times, ls = [], []
        for idx, tgt in data:
            sync(dev)
            t0 = time.perf_counter()
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ls.append(loss.item())  # .item() waits for the step (and the copy back with offload)
            sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
        key = "offload" if offload else "device"
        losses[key] = ls
        out[f"{key}_step_ms"] = statistics.median(times[1:])  # the first step allocates
        del model, opt
    # What the offload step would cost with nothing overlapped: the host Adam on the whole fp32 master,
    # and the copies (bf16 gradients down, bf16 weights up) at the measured engine speeds.
    n = out["params"]
    master = [torch.nn.Parameter(torch.randn(n))]
    master[0].grad = torch.randn(n)
    host_opt = CPUAdam(master, lr=1e-4, weight_decay=0.01)
    out["cpu_adam_ms"] = median_ms(host_opt.step, torch.device("cpu"), 3)
    del master, host_opt
    copies = offload_copies(dev, 2 * n, 3)
    e = 4 if dry else 2
    out["copies_ms"] = n * e / 1e9 * (1e3 / copies["engine_d2h_GBps"] + 1e3 / copies["engine_h2d_GBps"])
    serial = out["device_step_ms"] + out["cpu_adam_ms"] + out["copies_ms"]
    out["serial_estimate_ms"] = serial
    out["hidden_ms"] = serial - out["offload_step_ms"]
    out["losses_device"], out["losses_offload"] = losses["device"], losses["offload"]
    rtol = 1e-4 if dry else 2e-2  # bf16 compute: the two updaters round in different places
    out["losses_equal"] = bool(torch.allclose(torch.tensor(losses["offload"]), torch.tensor(losses["device"]),
                                              rtol=rtol))
    if not out["losses_equal"]:
        out["error"] = f"ZeRO-Offload losses {losses['offload']} differ from on-device {losses['device']}"
    return out


def step_zero_offload(dry: bool, budget_s: float) -> dict:
    """ZeRO-2 + offload on the GPU (bf16 compute, fp32 master and CPU Adam on the host) against the same
    ZeRO-2 on the device, GPT-2 small (124M), batch 8 x 512, 5 steps each (~25 s). CPU part: tiny, gloo."""
    import pyparallel

    cpu = pyparallel.launch(_zero_offload_body, 1, (True, "tiny", 4, 16, 3), timeout_s=time_left(LAUNCH_MARGIN_S))[0]
    save_part("cpu", cpu)
    cuda = NOT_RUN
    if not dry:
        cuda = pyparallel.launch(_zero_offload_body, 1, (False, "gpt2-small", 8, 512, 5),
                                 timeout_s=time_left(LAUNCH_MARGIN_S))[0]
    return {"cpu": cpu, "cuda": cuda}


WRAPPERS = ("DataParallel", "ZeRO-3", "TP", "PP", "ZeRO-3 bf16")


def _gpt_steps(preset: str, batch: int, seq: int, steps: int):
    from pyparallel.models.gpt import gpt_config, synthetic_batch

    cfg = gpt_config(preset)
    return cfg, [synthetic_batch(cfg, batch, seq, seed=100 + s) for s in range(steps)]


def _reference_losses(preset, batch, seq, steps) -> list[float]:
    """The plain model on the CPU in fp32: what every wrapper on the GPU must reproduce."""
    from pyparallel.models.gpt import GPT

    cfg, data = _gpt_steps(preset, batch, seq, steps)
    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    out = []
    for idx, tgt in data:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _wrappers_body(dry: bool, preset: str, batch: int, seq: int, steps: int) -> dict:
    import pyparallel
    from pyparallel import DataParallel, zero
    from pyparallel.models.gpt import GPT
    from pyparallel.pipeline_parallel import PipelineParallel
    from pyparallel.tensor_parallel import parallelize

    mesh = pyparallel.init(backend="gloo" if dry else "nccl")
    dev = mesh.device
    cfg, data = _gpt_steps(preset, batch, seq, steps)
    out = {"backend": mesh.backend, "device": str(dev), "model": preset, "rows": {}}

    def run(name):
        fresh = GPT(cfg, seed=0).to(dev)
        if name == "DataParallel":
            wrapped, opt = DataParallel(fresh, mesh), torch.optim.AdamW(fresh.parameters(), **HP)
        elif name.startswith("ZeRO-3"):
            wrapped, opt = zero.setup(fresh, mesh, stage=3, optimizer=torch.optim.AdamW,
                                      param_dtype=torch.bfloat16 if "bf16" in name else None, **HP)
        elif name == "TP":
            wrapped = parallelize(fresh, mesh)
            opt = torch.optim.AdamW(wrapped.parameters(), **HP)
        else:
            wrapped = PipelineParallel(fresh, mesh, schedule="1f1b", num_microbatches=2)
            opt = torch.optim.AdamW(wrapped.parameters(), **HP)
        losses = []
        for idx, tgt in data:
            idx, tgt = idx.to(dev), tgt.to(dev)
            if name == "PP":
                loss = wrapped.step(idx, tgt)
            else:
                loss = wrapped(idx, tgt)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()) if torch.is_tensor(loss) else float(loss))
        return losses

    for name in WRAPPERS:
        try:
            out["rows"][name] = {"losses": run(name)}
        except Exception as exc:  # noqa: BLE001 (one wrapper failing must not hide the others)
            out["rows"][name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return out


def step_wrappers(dry: bool, budget_s: float) -> dict:
    """One process, world size 1, NCCL on the GPU: the built-in GPT ("bench" preset, batch 8 x 128) for 3
    steps through DataParallel, ZeRO-3 (fp32 and bf16), TP and PP; losses against the CPU fp32 reference
    (fp32 rtol 1e-4; bf16 rtol 2e-2). ~20 s, most of it NCCL's start. CPU part (dry run only: on the GPU
    machine the reference is the CPU result): the same on the tiny GPT with gloo."""
    import pyparallel

    args = ("tiny", 4, 32, 3) if dry else ("bench", 8, 128, 3)
    ref = _reference_losses(*args)

    def check(part):
        for name, row in part["rows"].items():
            rtol = 2e-2 if "bf16" in name else (1e-5 if part["backend"] == "gloo" else 1e-4)
            row["rtol"] = rtol
            row["equal"] = "losses" in row and bool(torch.allclose(torch.tensor(row["losses"]), torch.tensor(ref),
                                                                   rtol=rtol, atol=1e-6))
            if "losses" in row and len(row["losses"]) == len(ref):  # how close, beside the pass/fail at rtol
                got, want = torch.tensor(row["losses"], dtype=torch.float64), torch.tensor(ref, dtype=torch.float64)
                row["max_rel_diff"] = float(((got - want).abs() / want.abs()).max())
        part["reference"] = ref
        bad = [name for name, row in part["rows"].items() if not row["equal"]]
        if bad:
            part["error"] = f"wrappers differ from the CPU reference or failed: {bad}"
        return part

    if dry:
        cpu = check(pyparallel.launch(_wrappers_body, 1, (True, *args), timeout_s=time_left(LAUNCH_MARGIN_S))[0])
    else:
        cpu = {"reference": ref, "model": args[0], "note": "plain GPT, fp32, no wrapper"}
    save_part("cpu", cpu)
    cuda = NOT_RUN if dry else check(pyparallel.launch(_wrappers_body, 1, (False, *args),
                                                       timeout_s=time_left(LAUNCH_MARGIN_S))[0])
    return {"cpu": cpu, "cuda": cuda}


# ------------------------------------------------------------------------------------------ gelu_linear

GELU_SHAPES = {  # name: (M tokens, K = MLP width, N = hidden, GeLU form the model uses)
    "gpt2-xl 1600-6400-1600": (8192, 6400, 1600, "tanh"),
    "llama-7b 4096-11008-4096": (4096, 11008, 4096, "none"),
}


def saved_bytes(fn, args, params) -> int:
    """Bytes of the activations autograd saves for backward in ``fn(*args)``: every saved storage once,
    less the parameters (``params``: the weight and bias, which the layer holds whether or not it saves)."""
    seen, total = {p.untyped_storage().data_ptr() for p in params}, 0

    def pack(t):
        nonlocal total
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total


def gelu_case(dev, name, m, k, n, approximate, dtype, iters) -> dict:
    import gelu_linear_cuda as G  # the eager/fused pair and the error check of benchmarks/gelu_linear_cuda.py

    gen = torch.Generator(device=dev).manual_seed(0)
    z = torch.randn(m, k, device=dev, generator=gen).to(dtype)
    b = torch.randn(k, device=dev, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(dtype)
    g = torch.randn(m, n, device=dev, generator=gen).to(dtype)
    exact = [t.detach() for t in G.run_once(G.eager, z.float(), b.float(), w.float(), g.float(), approximate)]
    errs = {}
    for label, fn in (("eager", G.eager), ("fused", G.fused)):
        got = G.run_once(fn, z, b, w, g, approximate)
        errs[label] = [float((a.detach().float() - e).abs().max()) for a, e in zip(got, exact)]
    scale = [float(x.abs().max()) for x in exact]
    ok = all(f <= 1.5 * e + 1e-3 * s for f, e, s in zip(errs["fused"], errs["eager"], scale))
    del exact
    row = {"shape": name, "M,K,N": f"{m},{k},{n}", "dtype": str(dtype).split(".")[-1], "approximate": approximate,
           "max_err_fused": errs["fused"], "max_err_eager": errs["eager"], "fused_no_worse": ok}
    # The autograd leaves once, outside the timed calls: run_once copies z, b and w into fresh leaves, and
    # that copy (100 MiB of z at the GPT-2 XL shape) would be timed too.
    leaves = G._leaves(z, b, w)

    def fwd_bwd(fn):
        for t in leaves:
            t.grad = None  # fresh gradients each call, not an accumulate into the last call's
        fn(*leaves, approximate).backward(g)

    for label, fn in (("eager", G.eager), ("fused", G.fused)):
        row[f"{label}_fwd_ms"] = median_ms(lambda fn=fn: fn(*leaves, approximate), dev, iters)
        row[f"{label}_fwd_bwd_ms"] = median_ms(lambda fn=fn: fwd_bwd(fn), dev, iters)
        zl, bl, wl = leaves
        row[f"{label}_saved_MiB"] = saved_bytes(fn, (zl, bl, wl, approximate), (bl, wl)) / 2**20
    row["fwd_speedup"] = row["eager_fwd_ms"] / row["fused_fwd_ms"]
    row["fwd_bwd_speedup"] = row["eager_fwd_bwd_ms"] / row["fused_fwd_bwd_ms"]
    return row


def step_gelu(dry: bool, budget_s: float) -> dict:
    """gelu_linear vs eager in bf16 at the GPT-2 XL and LLaMA-7B MLP shapes, forward and forward+backward,
    errors against fp32 and the bytes autograd saves (~15 s). CPU part: fp32, shapes / 64 in M."""
    from pyparallel import _ops

    def run(dev, dtype, shrink, iters):
        kernel = _ops.has_kernel("gelu_linear", dev) and _ops.has_kernel("gelu_linear_backward", dev)
        if dev.type == "cuda" and not kernel:  # "fused" would be the plain-torch recompute fallback
            return {"kernel": False, "rows": [], "error": "no CUDA gelu_linear kernels "
                    f"({_ops._EXT_ERROR or 'the extension was built without CUDA'})"}
        rows = [gelu_case(dev, name, m // shrink, k, n, a, dtype, iters)
                for name, (m, k, n, a) in GELU_SHAPES.items()]
        part = {"kernel": kernel, "rows": rows}
        bad = [r["shape"] for r in rows if not r["fused_no_worse"]]
        if bad:
            part["error"] = f"gelu_linear is less accurate than eager at {bad}"
        return part

    cpu = run(torch.device("cpu"), torch.float32, 64, 2)
    save_part("cpu", cpu)
    return {"cpu": cpu, "cuda": NOT_RUN if dry else run(torch.device("cuda"), torch.bfloat16, 1, 10)}


# --------------------------------------------------------------------------------------- steps, report

# name: (function, budget in seconds on one H100/H200). Sum: 410 s; gpu_check.sh gives each step its
# budget as a hard `timeout` (plus 10 s to die after SIGTERM), starts a step only while TOTAL_BUDGET_S
# (from its own start) leaves room for its whole budget, and so ends inside 8 minutes with the report.
STEPS = {
    "env": (step_env, 10),
    "build": (step_build, 180),
    "tests": (step_tests, 60),
    "adam": (step_adam, 35),
    "offload": (step_offload, 30),
    "zero_offload": (step_zero_offload, 35),
    "gelu": (step_gelu, 25),
    "wrappers": (step_wrappers, 35),
}
TOTAL_BUDGET_S = 450


def run_step(name: str, fn, budget_s: float, dry: bool, work: Path, deadline: float | None = None) -> int:
    """Runs one step, writes ``work/steps/<name>.json`` whatever happens; returns 0 on success, 1 if it raised
    or a part of it carries an error. ``deadline`` (epoch seconds; default now + budget) bounds the
    launches and builds inside it."""
    global WORK, DEADLINE, _REC
    WORK, DEADLINE = Path(work), deadline if deadline is not None else time.time() + budget_s
    # "running" until it ends: a record left so was killed, and the report says so with the parts it has.
    rec = _REC = {"step": name, "budget_s": budget_s, "dry_run": dry, "status": "running"}
    t0 = time.perf_counter()
    try:
        rec.update(fn(dry, budget_s))
        errors = [f"{where}: {rec[where]['error']}" for where in ("cpu", "cuda")
                  if isinstance(rec.get(where), dict) and rec[where].get("error")]
        if errors:
            rec.update(status="failed", error="; ".join(errors)[:4000])
        else:
            rec["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 (recorded; the driver goes on with the next step)
        rec.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:4000],
                   traceback=traceback.format_exc()[-4000:])
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    _save_record()
    _REC = None
    print(f"[gpu_check] {name}: {rec['status']} in {rec['seconds']} s (budget {budget_s} s)"
          + (f": {rec['error']}" if "error" in rec else ""))
    if "traceback" in rec:
        print(rec["traceback"], file=sys.stderr)
    return 0 if rec["status"] == "ok" else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", help="run one step (see --list)")
    ap.add_argument("--list", action="store_true", help="print 'name budget_s' per step, then 'total S'")
    ap.add_argument("--kernels", action="store_true", help=argparse.SUPPRESS)  # the build step's fresh probe
    ap.add_argument("--dry-run", action="store_true", help="CPU parts only; CUDA parts recorded as not run")
    ap.add_argument("--work", default=os.environ.get("GPU_CHECK_WORK", "benchmarks/out/gpu"),
                    help="scratch folder: the step's record goes to WORK/steps/<step>.json")
    ap.add_argument("--deadline", type=float, default=None,
                    help="epoch seconds by which the step must end (the driver's timeout; default now + budget)")
    a = ap.parse_args(argv)
    if a.list:
        for name, (_, budget) in STEPS.items():
            print(name, budget)
        print("total", TOTAL_BUDGET_S)
        return 0
    if a.kernels:
        print(json.dumps(_kernels()))
        return 0
    if a.step not in STEPS:
        print(f"gpu_check: unknown step {a.step!r}; steps: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run for the CPU parts)", file=sys.stderr)
        return 2
    fn, budget = STEPS[a.step]
    deadline = a.deadline if a.deadline is not None else time.time() + budget
    # A hang leaves every thread's traceback in the step's log 3 s before the driver's timeout kills it.
    faulthandler.dump_traceback_later(max(deadline - time.time() - 3, 1), exit=False)
    return run_step(a.step, fn, budget, a.dry_run, Path(a.work), deadline)


if __name__ == "__main__":
    sys.exit(main())
