"""Fixtures shared by several test files."""

import pytest


@pytest.fixture(params=["native", "python"])
def split_analysis(request, monkeypatch):
    """Runs a zero-bubble split test on both implementations of B's graph analysis and capture: the C++
    ``pyparallel._C.split_plan`` and the Python reference ``split._analyse`` (pipeline_parallel/split.py)."""
    from pyparallel.pipeline_parallel import split

    if request.param == "python":
        monkeypatch.setattr(split, "_native", lambda: None)
    elif split._native() is None:
        pytest.skip("pyparallel._C is not built: only the Python analysis exists")
    return request.param
