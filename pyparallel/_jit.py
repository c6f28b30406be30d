"""Find the compiled extension, or compile it on first use (the way DeepSpeed's op builder does).

``pip install --no-build-isolation -e .`` builds ``pyparallel._C`` ahead of time. A plain ``pip install .``
or ``pip install git+URL`` builds in an isolated environment without torch, so the package arrives without
it; then the first op that asks compiles the same sources with the same flags (pyparallel/_build.py)
through ``torch.utils.cpp_extension.load``, against the torch that is running, into a per-user cache:

    $PYPARALLEL_CACHE_DIR, else $XDG_CACHE_HOME/pyparallel, else ~/.cache/pyparallel
        ext/<torch version>-<python>-<cpu|cuda>-<hash of sources, flags and ABI>/pyparallel_C.so

A lock file beside each build folder lets one process compile while the other ranks of the job wait, and
later processes import the cached library without a compiler. A build that fails is remembered (its log is
in the folder), so that every rank of every later run does not spend minutes failing again; delete the
folder to retry. Switches: ``PYPARALLEL_NO_EXT=1`` uses the plain-torch references and neither loads nor
compiles anything; ``PYPARALLEL_CUDA=0/1`` leaves the CUDA sources out / forces them in, as in setup.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import time
from types import ModuleType

from pyparallel import _build

MODULE_NAME = "pyparallel_C"  # TORCH_EXTENSION_NAME of the compiled-on-use build (PyInit_pyparallel_C)
_OK_MARK = "built.ok"
_FAILED_MARK = "build.failed"

# How the extension was found, for tests and for a user asking why ops are slow: "prebuilt", "compiled",
# "cache", or None (not loaded); the build folder and the compile time when there was one.
info: dict = {"how": None, "dir": None, "seconds": None}


def cache_root() -> str:
    explicit = os.environ.get("PYPARALLEL_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pyparallel")


def csrc_dir() -> str | None:
    """The installed copy of csrc/ (a wheel), else the checkout's own (an editable or in-tree run)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, _build.CSRC_IN_PACKAGE), os.path.join(os.path.dirname(here), "csrc")):
        if os.path.isfile(os.path.join(candidate, "ops.cpp")):
            return candidate
    return None


def load() -> tuple[ModuleType | None, str | None]:
    """(the extension module, None), or (None, why not) for the one fallback warning in _ops."""
    if _build.env_flag("PYPARALLEL_NO_EXT"):
        return None, "PYPARALLEL_NO_EXT=1 is set"
    if _prebuilt_present():
        # Built at install time. If it is there but does not import (a torch upgraded under it), say so
        # rather than hide it behind a second build: the fix is to reinstall.
        try:
            from pyparallel import _C
        except ImportError as exc:
            return None, (f"the installed pyparallel._C does not import ({exc}); reinstall with "
                          "`pip install --no-build-isolation -e .`")
        info.update(how="prebuilt")
        return _C, None
    try:
        return _compile_or_reuse(), None
    except _NoBuild as exc:
        return None, str(exc)


def _prebuilt_present() -> bool:
    # Beside this file only: importlib's lookup could also reach another pyparallel checkout (an editable
    # install's finder answers for every pyparallel.* name), whose library is not this package's.
    here = os.path.dirname(os.path.abspath(__file__))
    return any(os.path.isfile(os.path.join(here, "_C" + suffix)) for suffix in importlib.machinery.EXTENSION_SUFFIXES)


class _NoBuild(Exception):
    """The extension cannot be compiled here; the message says why and what to do."""


def _build_plan():
    """Sources, flags and the cache folder for this torch; raises _NoBuild when nothing can be built."""
    csrc = csrc_dir()
    if csrc is None:
        raise _NoBuild("the C++ sources are not in the installed package (pyparallel/_csrc is missing); "
                       "reinstall pyparallel")
    _build.locate_cuda_home()  # before cpp_extension's first import, which fixes CUDA_HOME
    import torch
    from torch.utils import cpp_extension

    try:
        cuda = _build.want_cuda(torch.version.cuda, cpp_extension.CUDA_HOME, torch.__version__)
    except ValueError as exc:
        raise _NoBuild(str(exc)) from None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise _NoBuild(f"no C++ compiler to build it on first use ({compiler!r} is not on the PATH); install "
                       "one (g++), or set PYPARALLEL_NO_EXT=1 to silence this")
    if not cpp_extension.is_ninja_available():
        raise _NoBuild("building it on first use needs ninja (`pip install ninja`)")
    sources = _build.source_files(csrc, cuda)
    cflags = list(_build.CXX_FLAGS) + ([_build.CUDA_DEFINE] if cuda else [])
    cuda_flags = list(_build.NVCC_FLAGS) + [_build.CUDA_DEFINE] if cuda else []
    if cuda:
        _choose_cuda_archs()
    plan = {
        "sources": [os.path.abspath(s) for s in sources],
        "extra_cflags": cflags,
        "extra_cuda_cflags": cuda_flags,
        "extra_ldflags": list(_build.LINK_FLAGS),
        "extra_include_paths": _build.include_dirs(csrc, cpp_extension.CUDA_HOME if cuda else None),
        "with_cuda": cuda,
    }
    key = _cache_key(torch, csrc, plan)
    tag = f"torch{torch.__version__.split('+')[0]}-{sys.implementation.cache_tag}-" + (
        f"cu{torch.version.cuda}" if cuda else "cpu")
    return plan, os.path.join(cache_root(), "ext", f"{tag}-{key}")


def _choose_cuda_archs() -> None:
    # With a GPU visible torch compiles for it alone (fastest, and right for this machine); without one,
    # the same default as setup.py.
    from pyparallel import device

    if not device.cuda_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", _build.DEFAULT_CUDA_ARCHS)


def _cache_key(torch, csrc: str, plan: dict) -> str:
    """Everything that changes the binary: source and header bytes, flags, torch, its ABI and the archs."""
    from pyparallel import device

    h = hashlib.sha256()
    for rel in _build.shipped_files(csrc):
        h.update(rel.encode())
        with open(os.path.join(csrc, rel), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or ",".join(device.cuda_arch_names())
    for part in (plan["extra_cflags"], plan["extra_cuda_cflags"], plan["extra_ldflags"],
                 [torch.__version__, str(torch.version.cuda), str(torch._C._GLIBCXX_USE_CXX11_ABI),
                  sys.implementation.cache_tag, str(plan["with_cuda"]), archs if plan["with_cuda"] else ""]):
        h.update("\0".join(part).encode() + b"\1")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _exclusive(lock_path: str):
    """One builder per cache folder. flock is released by the kernel when its holder dies, so a rank killed
    mid-build never leaves the others waiting on a stale lock (torch's own lock file would)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's lock file inside the build folder still serializes
        yield
        return
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process that is compiling the extension ({lock_path})")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile_or_reuse() -> ModuleType:
    plan, folder = _build_plan()
    with _exclusive(folder + ".lock"):
        library = os.path.join(folder, MODULE_NAME + (".pyd" if os.name == "nt" else ".so"))
        if os.path.exists(os.path.join(folder, _OK_MARK)) and os.path.exists(library):
            module = _import_library(library)
            info.update(how="cache", dir=folder)
            return module
        failed = os.path.join(folder, _FAILED_MARK)
        if os.path.exists(failed):
            raise _NoBuild(f"an earlier attempt to compile it failed (log: {failed}); fix the cause and delete "
                           f"{folder} to retry")
        return _compile(plan, folder, failed)


def _compile(plan: dict, folder: str, failed: str) -> ModuleType:
    from torch.utils import cpp_extension

    os.makedirs(folder, exist_ok=True)
    # We hold the flock, so a leftover torch lock file is from a builder that died: it would block forever.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, "lock"))
    kinds = "C++ and CUDA kernels" if plan["with_cuda"] else "C++ kernels"
    _say(f"pyparallel._C was not built at install time; compiling it now ({kinds}, {len(plan['sources'])} "
         f"files) into {folder}. This happens once per torch version; set PYPARALLEL_NO_EXT=1 to skip it.")
    start = time.perf_counter()
    try:
        module = cpp_extension.load(name=MODULE_NAME, build_directory=folder, verbose=False, **plan)
    except Exception as exc:  # a compiler error, a missing header: fall back, and remember why
        with open(failed, "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\n")
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise _NoBuild(f"compiling it on first use failed ({last}); full log: {failed}") from None
    seconds = time.perf_counter() - start
    with open(os.path.join(folder, _OK_MARK), "w") as f:
        f.write(f"{seconds:.1f}\n")
    info.update(how="compiled", dir=folder, seconds=seconds)
    _say(f"compiled pyparallel._C in {seconds:.0f} s")
    return module


def _import_library(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


def _say(message: str) -> None:
    # stderr, flushed: a rank that sits compiling for minutes must say so while it happens.
    rank = os.environ.get("RANK")
    print(f"pyparallel{f' [rank {rank}]' if rank else ''}: {message}", file=sys.stderr, flush=True)
