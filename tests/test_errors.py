"""Failures end with an error on every rank that names the op, the group and the ranks; nothing hangs."""

import time

import pytest
import torch
import torch.distributed as dist
from dist import run

import pyparallel
from pyparallel import comm


def debug_mismatch_body():
    mesh = pyparallel.init()
    g = mesh.world_group
    with pytest.raises(pyparallel.CollectiveMismatchError) as info:
        if dist.get_rank() == 0:
            comm.all_reduce(torch.zeros(4), g)
        else:
            comm.all_gather(torch.zeros(4 * g.size), torch.zeros(4), g)
    return str(info.value)


@pytest.mark.parametrize("env", [{"PYPARALLEL_DEBUG": "1"}, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}])
def test_debug_mode_names_both_sides_of_a_mismatch(env):
    for msg in run(debug_mismatch_body, 2, env=env):
        assert "rank 0: call #1 all_reduce(shape=(4,)" in msg
        assert "rank 1: call #1 all_gather(shape=(4,)" in msg


def shape_mismatch_body():
    mesh = pyparallel.init()
    n = 3 if dist.get_rank() == 0 else 5
    with pytest.raises(pyparallel.CollectiveMismatchError) as info:
        comm.all_reduce(torch.zeros(n), mesh.world_group)
    return str(info.value)


def test_debug_mode_catches_shape_mismatch():
    for msg in run(shape_mismatch_body, 2, env={"PYPARALLEL_DEBUG": "1"}):
        assert "shape=(3,)" in msg and "shape=(5,)" in msg


BIG = 1 << 17  # elements: 1 MiB of all-gather output / reduce-scatter input, so gloo takes its direct paths
SKIPPED = {
    "all_reduce": lambda g: comm.all_reduce(torch.ones(3), g),
    "all_gather": lambda g: comm.all_gather(torch.empty(2 * BIG), torch.ones(BIG), g),
    "reduce_scatter": lambda g: comm.reduce_scatter(torch.empty(BIG), torch.ones(2 * BIG), g),
}


def timeout_body(timeout_s, op, transport):
    mesh = pyparallel.init(timeout_s=timeout_s)
    comm.all_reduce(torch.ones(1), mesh.world_group)
    assert bool(mesh.world_group.arena) == (transport == "shm")
    if dist.get_rank() == 1:
        time.sleep(timeout_s + 4)  # skip the collective, but stay alive past the peer's timeout
        return None
    start = time.monotonic()
    with pytest.raises(pyparallel.CollectiveTimeoutError) as info:
        SKIPPED[op](mesh.world_group)
    return str(info.value), time.monotonic() - start


@pytest.mark.parametrize("transport", ["gloo", "shm"])
@pytest.mark.parametrize("op", list(SKIPPED))
def test_skipped_collective_times_out_with_a_named_error(op, transport):
    # "gloo": the backend's own timeout; "shm": the first collective opened the group's shared-memory
    # transport (comm.py), whose waits enforce the same timeout themselves.
    env = {"PYPARALLEL_SHM": "1" if transport == "shm" else "0"}
    msg, waited = run(timeout_body, 2, 3.0, op, transport, env=env, fresh_after=True)[0]
    assert f"{op} on group 'world'" in msg and "global ranks [0, 1]" in msg and "rank 0" in msg
    assert "did not complete within 3 s" in msg
    if transport == "shm":
        assert "global rank 1 is behind" in msg
    assert waited < 30  # bounded by the group's timeout, not the 300 s default


def p2p_timeout_body(timeout_s):
    """Rank 0 sends rank 1 a message larger than the shared-memory ring that rank 1 never takes; then rank 0
    waits for a message rank 1 never sends. Each must end on rank 0 with a named error at the group's
    timeout. Last, a receive whose buffer is smaller than the message sent is refused on the receiver."""
    from pyparallel import shm

    mesh = pyparallel.init(timeout_s=timeout_s)
    g = mesh.world_group
    comm.send(torch.ones(1), 1 - g.rank, g)  # both ways once: opens the channel
    comm.recv(torch.ones(1), 1 - g.rank, g)
    out = []
    if g.rank == 0:
        big = torch.ones((shm.SLOTS + 1) * shm.slot_bytes() // 4)
        h = comm.send(big, 1, g, async_op=True)  # returns at once: the writer thread holds the rest
        assert not h.is_completed()
        for wait in (h.wait, lambda: comm.recv(torch.empty(3), 1, g)):
            start = time.monotonic()
            with pytest.raises(pyparallel.CollectiveTimeoutError) as info:
                wait()
            out.append((str(info.value), time.monotonic() - start))
    else:
        time.sleep(2 * timeout_s + 2)
    comm.barrier(g)
    if g.rank == 1:  # 1 -> 0 is still in step: send 5 elements where the peer expects 3
        comm.send(torch.ones(5), 0, g)
    else:
        with pytest.raises(pyparallel.CollectiveMismatchError) as info:
            comm.recv(torch.empty(3), 1, g)
        out.append((str(info.value), 0.0))
    comm.barrier(g)
    return out, g.channel not in (None, False)


def test_a_point_to_point_message_never_taken_or_never_sent_times_out_with_a_named_error():
    (out, shm0), (_, shm1) = run(p2p_timeout_body, 2, 3.0, env={"PYPARALLEL_SHM": "1"}, fresh_after=True)
    assert shm0 and shm1
    (send_msg, send_waited), (recv_msg, recv_waited), (mismatch, _) = out
    assert "send on group 'world'" in send_msg and "the receiver did not take the earlier messages" in send_msg
    assert "global rank 1 is behind" in send_msg and "did not complete within 3 s" in send_msg
    assert "recv on group 'world'" in recv_msg and "the sender never sent it" in recv_msg
    assert "global rank 1 is behind" in recv_msg
    assert 2.5 < send_waited < 30 and 2.5 < recv_waited < 30
    assert "recv on group 'world'" in mismatch and "a receive of 12 bytes met a message of 20 bytes" in mismatch
    assert "global rank 1" in mismatch


def bad_degrees_body():
    with pytest.raises(ValueError) as info:
        pyparallel.init(dp=3, tp=2)
    return str(info.value)


def test_wrong_degrees_fail_before_any_collective():
    for msg in run(bad_degrees_body, 4):
        assert "dp (3) x tp (2) x pp (1) = 6 does not equal the world size 4" in msg


def test_degree_validation_is_local():
    from pyparallel.mesh import resolve_degrees

    assert resolve_degrees(8, None, 2, 2) == (2, 2, 2)
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp \\(4\\)"):
        resolve_degrees(6, None, 4, 1)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        resolve_degrees(4, None, 0, 1)
