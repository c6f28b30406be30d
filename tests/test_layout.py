"""The tree keeps its doors: collectives only in comm.py, torch.cuda only in device.py (DESIGN.md, 3)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "pyparallel"
COLLECTIVE = re.compile(
    r"\b(dist|torch\.distributed)\.(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|send|recv|isend|irecv|"
    r"barrier|all_to_all\w*|batch_isend_irecv|reduce|gather|scatter)\b"
)
CUDA = re.compile(r"\btorch\.cuda\b")


def _strays(pattern, allowed):
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == allowed and path.parent == ROOT:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                found.append(f"{path.relative_to(ROOT.parent)}:{i}: {line.strip()}")
    return found


def test_collectives_only_in_comm():
    assert _strays(COLLECTIVE, "comm.py") == []


def test_torch_cuda_only_in_device():
    assert _strays(CUDA, "device.py") == []


def test_the_grep_would_catch_a_stray():
    assert COLLECTIVE.search("    dist.all_reduce(t)") and CUDA.search("torch.cuda.synchronize()")
