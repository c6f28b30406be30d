"""Helpers for tests that drive real torchrun processes."""

import json
import subprocess
import time

from pyparallel.launch import free_port


def result(stdout: str) -> dict:
    """The JSON a script printed on its last ``RESULT {...}`` line."""
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def two_nodes(command_for, env, cwd, timeout=240) -> list[str]:
    """Start two torchrun "nodes" (one process each) on 127.0.0.1 with a c10d rendezvous and return each
    node's stdout. ``command_for(rdzv_args)`` builds a node's command line from its torchrun arguments."""
    port = free_port()
    procs = []
    for node in range(2):
        rdzv = ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"pp-test-{port}"]
        procs.append(subprocess.Popen(command_for(rdzv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, cwd=cwd))
        time.sleep(0.5)
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, out[-2000:] + err[-3000:]
        outs.append(out)
    return outs
