"""Build pyparallel and its extension ``pyparallel._C``.

C++ sources (csrc/*.cpp, csrc/cpu, csrc/offload) are always compiled; CUDA sources (csrc/cuda/*.cu) are
added whenever torch is a CUDA build and nvcc is found. Environment switches:

- ``PYPARALLEL_CUDA=0/1``  force the CUDA sources off / on (on without a toolkit is an error).
- ``PYPARALLEL_NO_EXT=1``  pure-Python install; every op falls back to its plain-torch reference.
- ``TORCH_CUDA_ARCH_LIST``  defaults to "8.0;9.0" (A100, H100/H200) when no GPU is visible at build time.

torch must already be installed: build with ``pip install --no-build-isolation -e .`` so that the extension
is compiled against the torch you run (an isolated build would fetch another torch and break the ABI).
"""

import glob
import os
import shutil
import site
import subprocess
import sys

from setuptools import find_packages, setup


def _env_flag(name):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value.lower() not in ("0", "false", "no", "off")


def _nvidia_wheel_includes():
    """Header folders shipped by the nvidia-* pip wheels (cusparse.h, cublas_v2.h ...), which ATen's CUDA
    headers include but a minimal system toolkit may lack."""
    roots = site.getsitepackages() + [site.getusersitepackages()]
    found = []
    for root in roots:
        for inc in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include"))):
            if os.path.isdir(inc):
                found.append(inc)
    return found


def _locate_cuda_home():
    """Set CUDA_HOME from nvcc when unset. A wrapper script on the PATH (/usr/local/bin/nvcc exec-ing the
    real one) would make torch guess the wrong root, so ask nvcc itself where its toolkit lives."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    try:
        out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return
    for line in (out.stdout + out.stderr).splitlines():
        if "TOP=" in line:
            top = os.path.normpath(line.split("TOP=", 1)[1].strip())
            if os.path.isdir(os.path.join(top, "include")):
                os.environ["CUDA_HOME"] = top
            return


def _extensions():
    if _env_flag("PYPARALLEL_NO_EXT"):
        return [], {}
    _locate_cuda_home()
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:  # pragma: no cover - build-time guidance
        sys.exit(
            "pyparallel: building the extension needs torch installed first. Install torch, then run "
            "`pip install --no-build-isolation -e .` (or set PYPARALLEL_NO_EXT=1 for pure Python). "
            f"({exc})"
        )

    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp") + glob.glob("csrc/offload/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
    cuda_possible = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    forced = _env_flag("PYPARALLEL_CUDA")
    use_cuda = cuda_possible if forced is None else forced
    if use_cuda and not cuda_possible:
        sys.exit(
            f"pyparallel: PYPARALLEL_CUDA=1 but torch {torch.__version__} is "
            f"{'a CPU build' if torch.version.cuda is None else 'a CUDA build'} and CUDA_HOME is "
            f"{cpp_extension.CUDA_HOME!r}; install a CUDA build of torch and put nvcc on the PATH."
        )

    include_dirs = [os.path.abspath("csrc/include")]
    cxx = ["-O3", "-fopenmp", "-Wall", "-Wno-unused-function"]
    define_macros = []
    kwargs = {}
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        system_inc = os.path.join(cpp_extension.CUDA_HOME, "include")
        if not os.path.exists(os.path.join(system_inc, "cusparse.h")):
            include_dirs += _nvidia_wheel_includes()
        define_macros.append(("PYPARALLEL_WITH_CUDA", "1"))
        ext_cls = cpp_extension.CUDAExtension
        kwargs["extra_compile_args"] = {
            "cxx": cxx + ["-DPYPARALLEL_WITH_CUDA=1"],
            "nvcc": ["-O3", "-DPYPARALLEL_WITH_CUDA=1", "--expt-relaxed-constexpr"],
        }
        sources = sources + cuda_sources
    else:
        ext_cls = cpp_extension.CppExtension
        kwargs["extra_compile_args"] = {"cxx": cxx}
    ext = ext_cls(
        name="pyparallel._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_link_args=["-fopenmp"],
        **kwargs,
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    packages=find_packages(include=["pyparallel", "pyparallel.*"]),
    package_data={"pyparallel.data": ["*.txt"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
