"""Build pyparallel and its extension ``pyparallel._C``.

C++ sources (csrc/*.cpp, csrc/cpu, csrc/offload) are always compiled; CUDA sources (csrc/cuda/*.cu) are
added whenever torch is a CUDA build and nvcc is found. The source list and flags live in
pyparallel/_build.py, shared with the loader that compiles the same extension on first use. Environment
switches:

- ``PYPARALLEL_CUDA=0/1``  force the CUDA sources off / on (on without a toolkit is an error).
- ``PYPARALLEL_NO_EXT=1``  pure-Python install; every op falls back to its plain-torch reference.
- ``TORCH_CUDA_ARCH_LIST``  defaults to "8.0;9.0" (A100, H100/H200).

Two ways to install:

- ``pip install --no-build-isolation -e .`` compiles the extension now, against the torch you run.
- ``pip install .`` / ``pip install git+URL`` (pip's isolated build) has no torch to compile against, and
  must not fetch one (a second multi-GB torch, with another ABI): it installs pure Python plus a copy of
  csrc/ (``pyparallel/_csrc``), and pyparallel/_jit.py compiles the extension on first use.
"""

import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


def _load_build_config():
    """pyparallel/_build.py by path: importing the package would import torch, which may be absent here."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyparallel", "_build.py")
    spec = importlib.util.spec_from_file_location("_pyparallel_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


B = _load_build_config()


class BuildPyWithSources(build_py):
    """Copy csrc/ into the built package as ``pyparallel/_csrc``: setuptools' package_data only takes files
    inside a package folder, and the sources must stay at csrc/ for the CMake build and the ctest suite."""

    def run(self):
        super().run()
        if self.editable_mode:  # an editable install compiles from the checkout's own csrc/
            return
        target = os.path.join(self.build_lib, "pyparallel", B.CSRC_IN_PACKAGE)
        for rel in B.shipped_files("csrc"):
            dst = os.path.join(target, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(os.path.join("csrc", rel), dst)


def _extensions():
    if B.env_flag("PYPARALLEL_NO_EXT"):
        return [], {}
    B.locate_cuda_home()
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        # pip's isolated build: no torch here, and fetching one would break the ABI (see the docstring).
        print("pyparallel: torch is not importable in this build environment (pip's build isolation); "
              "installing pure Python with the C++/CUDA sources. The extension pyparallel._C is compiled on "
              "first use (or install with `pip install --no-build-isolation .` to compile it now).",
              file=sys.stderr)
        return [], {}

    try:
        use_cuda = B.want_cuda(torch.version.cuda, cpp_extension.CUDA_HOME, torch.__version__)
    except ValueError as exc:
        sys.exit(f"pyparallel: {exc}")

    sources = B.source_files("csrc", use_cuda)
    include_dirs = B.include_dirs("csrc", cpp_extension.CUDA_HOME if use_cuda else None)
    kwargs = {}
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", B.DEFAULT_CUDA_ARCHS)
        ext_cls = cpp_extension.CUDAExtension
        kwargs["extra_compile_args"] = {
            "cxx": B.CXX_FLAGS + [B.CUDA_DEFINE],
            "nvcc": B.NVCC_FLAGS + [B.CUDA_DEFINE],
        }
    else:
        ext_cls = cpp_extension.CppExtension
        kwargs["extra_compile_args"] = {"cxx": list(B.CXX_FLAGS)}
    ext = ext_cls(
        name="pyparallel._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_link_args=list(B.LINK_FLAGS),
        **kwargs,
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPyWithSources

setup(
    packages=find_packages(include=["pyparallel", "pyparallel.*"]),
    package_data={"pyparallel.data": ["*.txt"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
