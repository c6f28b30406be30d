"""What ``pyparallel._C`` is compiled from and with: one list of sources and flags for both builds.

setup.py compiles the extension ahead of time (``pip install --no-build-isolation -e .``); pyparallel/_jit.py
compiles the same thing on first use when the install had no torch to build against (pip's isolated build,
``pip install git+URL``). Both read this file, so the two builds cannot drift apart. It imports only the
standard library: setup.py loads it by path inside a build environment that may lack torch.
"""

from __future__ import annotations

import glob
import os
import shutil
import site
import subprocess

# The installed package keeps a copy of csrc/ here (setup.py's build_py adds it), so that a wheel built
# without torch can still compile the extension later; a source checkout uses csrc/ itself.
CSRC_IN_PACKAGE = "_csrc"

# Files of csrc/ the extension is built from (relative to csrc/); csrc/tests is the CMake build's own.
SOURCE_GLOBS = ("*.cpp", "cpu/*.cpp", "offload/*.cpp", "autograd/*.cpp")
CUDA_SOURCE_GLOBS = ("cuda/*.cu", "cuda/*.cpp")
SHIPPED_GLOBS = SOURCE_GLOBS + CUDA_SOURCE_GLOBS + ("*.h", "cpu/*.h", "cuda/*.h", "cuda/*.cuh", "offload/*.h",
                                                    "autograd/*.h", "include/pyparallel/*.h")

# -g0: setup.py inherits Python's own CFLAGS, -g among them, and debug info for torch's templates doubles
# the compile time of the larger files (csrc/cpu/gelu_linear.cpp: 19 s -> 35 s) for a library nobody steps into.
CXX_FLAGS = ["-O3", "-g0", "-fopenmp", "-Wall", "-Wno-unused-function"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr"]
LINK_FLAGS = ["-fopenmp"]
CUDA_DEFINE = "-DPYPARALLEL_WITH_CUDA=1"
# A100 and H100/H200, for a build that cannot see the GPU it will run on.
DEFAULT_CUDA_ARCHS = "8.0;9.0"


def env_flag(name: str) -> bool | None:
    """True / False for a set switch (0, false, no, off are False), None when unset or empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value.lower() not in ("0", "false", "no", "off")


def source_files(csrc: str, cuda: bool) -> list[str]:
    """The translation units, sorted so that both builds (and the JIT cache key) see one order."""
    cpp = sorted(f for g in SOURCE_GLOBS for f in glob.glob(os.path.join(csrc, g)))
    cu = sorted(f for g in CUDA_SOURCE_GLOBS for f in glob.glob(os.path.join(csrc, g))) if cuda else []
    return cpp + cu


def shipped_files(csrc: str) -> list[str]:
    """Sources and headers, relative to ``csrc``: what a wheel needs to compile the extension later."""
    found = {os.path.relpath(f, csrc) for g in SHIPPED_GLOBS for f in glob.glob(os.path.join(csrc, g))}
    return sorted(found)


def nvidia_wheel_includes() -> list[str]:
    """Header folders shipped by the nvidia-* pip wheels (cusparse.h, cublas_v2.h ...), which ATen's CUDA
    headers include but a minimal system toolkit may lack."""
    roots = site.getsitepackages() + [site.getusersitepackages()]
    found = []
    for root in roots:
        for inc in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include"))):
            if os.path.isdir(inc):
                found.append(inc)
    return found


def include_dirs(csrc: str, cuda_home: str | None) -> list[str]:
    dirs = [os.path.abspath(os.path.join(csrc, "include"))]
    if cuda_home and not os.path.exists(os.path.join(cuda_home, "include", "cusparse.h")):
        dirs += nvidia_wheel_includes()
    return dirs


def locate_cuda_home() -> str | None:
    """Set CUDA_HOME from nvcc when unset, and return it. A wrapper script on the PATH (/usr/local/bin/nvcc
    exec-ing the real one) would make torch guess the wrong root, so ask nvcc itself where its toolkit
    lives. Must run before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import."""
    known = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if known:
        return known
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if "TOP=" in line:
            top = os.path.normpath(line.split("TOP=", 1)[1].strip())
            if os.path.isdir(os.path.join(top, "include")):
                os.environ["CUDA_HOME"] = top
                return top
            return None
    return None


def want_cuda(torch_cuda_version: str | None, cuda_home: str | None, torch_version: str) -> bool:
    """Whether the CUDA sources go in: when possible (a CUDA build of torch and a toolkit), unless
    PYPARALLEL_CUDA=0/1 forces it. Forcing it on without a toolkit raises ValueError, naming what is missing."""
    possible = torch_cuda_version is not None and cuda_home is not None
    forced = env_flag("PYPARALLEL_CUDA")
    if forced and not possible:
        raise ValueError(
            f"PYPARALLEL_CUDA=1 but torch {torch_version} is "
            f"{'a CPU build' if torch_cuda_version is None else 'a CUDA build'} and CUDA_HOME is {cuda_home!r}; "
            "install a CUDA build of torch and put nvcc on the PATH, or unset PYPARALLEL_CUDA.")
    return possible if forced is None else forced
