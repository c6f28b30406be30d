"""A plain `pip install .` (pip's isolated build, no torch in it) works, and the extension compiles on first use.

A fresh virtual environment that sees the system's torch (--system-site-packages) gets an isolated
`pip install <copy of this checkout>`, exactly as `pip install git+URL` would do it. The installed package
must carry the C++ sources and no prebuilt pyparallel._C; the first op then compiles the extension into an
empty cache (CPU kernels only, PYPARALLEL_CUDA=0, to keep this short), a second process reuses the cache
without compiling, and a process with no compiler falls back to the references with one warning.

Slow (a few minutes on 2 cores, mostly the compile), and it runs in CI: it is the only test of the install
path users take.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow

# Runs inside the venv: one op through the compiled kernel, checked against its plain-torch reference.
PROBE = textwrap.dedent("""
    import json, time, warnings
    start = time.perf_counter()
    import torch
    import pyparallel
    from pyparallel import _jit, _ops
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 2)]
    out, ref = torch.full((40,), 7.0), torch.full((40,), 7.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        _ops.flatten_into(tensors, out)
        _ops.flatten_into(tensors, out)
        _ops.unflatten_from(out, [torch.empty_like(t) for t in tensors])
    _ops.flatten_into_reference(tensors, ref)
    print(json.dumps({"file": pyparallel.__file__, "has_ext": _ops.HAS_EXT, "error": _ops._EXT_ERROR,
                      "kernel": _ops.has_kernel("flatten_into", torch.device("cpu")),
                      "with_cuda": bool(_ops._C.with_cuda) if _ops.HAS_EXT else None,
                      "equal": torch.equal(out, ref), "warnings": [str(w.message) for w in caught],
                      "info": _jit.info, "seconds": time.perf_counter() - start}))
""")


def _copy_checkout(dst: str) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored): no build outputs, no _C*.so."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout, cannot make a clean copy to install: {listed.stderr.decode()[:200]}")
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYPARALLEL_", "PYTHON"))}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("install")
    src, env_dir = base / "src", base / "venv"
    _copy_checkout(str(src))
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], check=True)
    python = str(env_dir / "bin" / "python")
    start = time.perf_counter()
    # No --no-build-isolation: pip builds in a fresh environment holding only setuptools and wheel.
    pip = subprocess.run([python, "-m", "pip", "install", str(src)], cwd=str(base), env=_clean_env(),
                         capture_output=True, text=True, timeout=900)
    if pip.returncode != 0 and "satisfies the requirement setuptools" in pip.stdout + pip.stderr:
        pytest.skip("pip could not fetch setuptools for the isolated build (no package index reachable): "
                    + (pip.stdout + pip.stderr)[-500:])
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    print(f"isolated pip install: {time.perf_counter() - start:.1f} s")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return {"python": python, "base": base, "package": os.path.join(site, "pyparallel")}


def _probe(venv, cache: str, **env) -> dict:
    run = subprocess.run([venv["python"], "-c", PROBE], cwd=str(venv["base"]), capture_output=True,
                         text=True, timeout=1500, env=_clean_env(PYPARALLEL_CACHE_DIR=cache, **env))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["stderr"] = run.stderr
    return result


def test_isolated_install_ships_sources_not_a_prebuilt_extension(venv):
    package = venv["package"]
    assert os.path.isfile(os.path.join(package, "__init__.py"))
    built = [f for f in os.listdir(package) if f.startswith("_C") and f.endswith((".so", ".pyd"))]
    assert built == [], f"an isolated build has no torch, so nothing should have been compiled: {built}"
    for rel in ("ops.cpp", "cpu/flatten.cpp", "cuda/flatten.cu", "include/pyparallel/checks.h"):
        assert os.path.isfile(os.path.join(package, "_csrc", rel)), rel


def test_first_use_compiles_then_the_cache_is_reused(venv):
    cache = str(venv["base"] / "cache")
    first = _probe(venv, cache, PYPARALLEL_CUDA="0")
    assert first["file"].startswith(venv["package"]), first["file"]  # the venv's copy, not the checkout
    assert first["has_ext"] and first["kernel"], first["error"]
    assert first["info"]["how"] == "compiled" and first["with_cuda"] is False
    assert first["equal"] and first["warnings"] == []
    assert "compiling it now" in first["stderr"]
    library = os.path.join(first["info"]["dir"], "pyparallel_C.so")
    stamp = os.stat(library).st_mtime_ns
    print(f"first use (compile): {first['info']['seconds']:.1f} s of {first['seconds']:.1f} s")

    second = _probe(venv, cache, PYPARALLEL_CUDA="0")
    assert second["info"]["how"] == "cache" and second["info"]["dir"] == first["info"]["dir"]
    assert second["has_ext"] and second["kernel"] and second["equal"] and second["warnings"] == []
    assert "compiling" not in second["stderr"], second["stderr"]
    assert os.stat(library).st_mtime_ns == stamp
    print(f"second use (cache): {second['seconds']:.1f} s")


def test_no_compiler_falls_back_with_one_warning(venv):
    result = _probe(venv, str(venv["base"] / "cache-nocc"), PYPARALLEL_CUDA="0",
                    CXX="pyparallel-no-such-compiler")
    assert not result["has_ext"] and result["info"]["how"] is None
    assert result["equal"], "the reference must give the same result"
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "no C++ compiler" in result["warnings"][0] and "plain-torch reference" in result["warnings"][0]


def test_no_ext_switch_neither_loads_nor_compiles(venv):
    cache = str(venv["base"] / "cache-noext")
    result = _probe(venv, cache, PYPARALLEL_NO_EXT="1")
    assert not result["has_ext"] and result["equal"] and len(result["warnings"]) == 1
    assert "PYPARALLEL_NO_EXT=1" in result["warnings"][0]
    assert not os.path.exists(cache), "PYPARALLEL_NO_EXT=1 must not start a build"
