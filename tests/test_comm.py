"""Collective conformance: every comm.py op x dtype x reduce op x world size 1-4 x even/uneven/empty sizes
against closed-form results, plus the byte accounting of each call."""

import glob
import os
import time

import pytest
import torch
from dist import run

import pyparallel
from pyparallel import _ops, comm, shm

DTYPES = [torch.float32, torch.bfloat16, torch.int64]
SIZES = {"even": 12, "uneven": 13, "empty": 0}
LARGE = 70_001  # elements: over 256 KiB of reduce-scatter input at every dtype and world >= 2
GATHER_LARGE = 270_001  # elements per rank: over 1 MiB of all-gather output at every dtype and world >= 2


def _value(rank, n, dtype):
    # Small integers: exact in bf16, so closed forms compare with equality.
    return ((rank + 1) * torch.arange(n) % 7 + rank).to(dtype)


def _expected(op, world, n, dtype):
    stack = torch.stack([_value(r, n, torch.float64) for r in range(world)])
    out = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0).values if n else stack.sum(0),
           "min": stack.min(0).values if n else stack.sum(0)}[op]
    return out.to(dtype)


def conformance_body():
    mesh = pyparallel.init()
    g = mesh.world_group
    world, rank = g.size, g.rank
    for dtype in DTYPES:
        for label, n in SIZES.items():
            for op in ["sum", "avg", "max", "min"]:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                t = _value(rank, n, dtype)
                comm.all_reduce(t, g, op=op)
                torch.testing.assert_close(t, _expected(op, world, n, dtype), rtol=0, atol=0,
                                           msg=f"all_reduce {op} {dtype} {label}")
                # reduce_scatter: every rank contributes world chunks of n elements.
                full = torch.cat([_value(rank, n, dtype) + c for c in range(world)])
                out = torch.empty(n, dtype=dtype)
                comm.reduce_scatter(out, full, g, op=op)
                shift = world * rank if op == "sum" else rank  # chunk k carries +k from every rank
                expect = _expected(op, world, n, torch.float64) + shift
                torch.testing.assert_close(out, expect.to(dtype), rtol=0, atol=0,
                                           msg=f"reduce_scatter {op} {dtype} {label}")
                # LARGE takes gloo's exchange path (comm._GLOO_EXCHANGE_BYTES), out of place and in place.
                full = torch.cat([_value(rank, LARGE, dtype) + c for c in range(world)])
                expect = (_expected(op, world, LARGE, torch.float64) + shift).to(dtype)
                out = torch.empty(LARGE, dtype=dtype)
                comm.reduce_scatter(out, full, g, op=op)
                torch.testing.assert_close(out, expect, rtol=0, atol=0, msg=f"reduce_scatter {op} {dtype} large")
                h = comm.reduce_scatter_in_place(full, g, op=op, async_op=True)
                h.wait()
                torch.testing.assert_close(full.view(world, -1)[rank], expect, rtol=0, atol=0,
                                           msg=f"reduce_scatter_in_place {op} {dtype} large")
            for m in (n, GATHER_LARGE):  # GATHER_LARGE: gloo's path through broadcasts (comm._GLOO_GATHER_BYTES)
                mine = _value(rank, m, dtype)
                expect = torch.cat([_value(r, m, dtype) for r in range(world)])
                gathered = torch.empty(world * m, dtype=dtype)
                comm.all_gather(gathered, mine, g)
                torch.testing.assert_close(gathered, expect, rtol=0, atol=0, msg=f"all_gather {dtype} {m}")
                inplace = torch.zeros(world * m, dtype=dtype)  # input already in its slot of the output
                inplace.view(world, -1)[rank].copy_(mine)
                comm.all_gather(inplace, inplace.view(world, -1)[rank], g, async_op=True).wait()
                torch.testing.assert_close(inplace, expect, rtol=0, atol=0, msg=f"in-place all_gather {m}")
                strided = torch.stack([mine, mine]).t()[:, 1]  # a non-contiguous input
                gathered.zero_()
                comm.all_gather(gathered, strided, g)
                torch.testing.assert_close(gathered, expect, rtol=0, atol=0, msg=f"strided all_gather {m}")
            for src in range(world):
                b = _value(rank, n, dtype)
                comm.broadcast(b, src, g)
                torch.testing.assert_close(b, _value(src, n, dtype), rtol=0, atol=0)
    # Async handles complete and apply their fallback post-processing on wait().
    t = torch.ones(5)
    h = comm.all_reduce(t, g, op="avg", async_op=True)
    h.wait()
    torch.testing.assert_close(t, torch.ones(5))
    comm.barrier(g)
    objs = comm.all_gather_object({"rank": rank}, g)
    assert [o["rank"] for o in objs] == list(range(world))
    return bool(g.arena)


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_conformance(world, transport):
    used_shm = world > 1 and transport == "shm"
    # Same-host gloo groups move collectives through shared memory unless PYPARALLEL_SHM=0 (comm.py).
    env = {"PYPARALLEL_SHM": "1" if transport == "shm" else "0"}
    assert run(conformance_body, world, env=env) == [used_shm] * world


def chunked_body():
    """Tensors several times one rank's shared-memory region (pyparallel/shm.py), so every collective runs
    in many rounds through both alternating sets of regions; float values, compared with the backend's."""
    mesh = pyparallel.init()
    g = mesh.world_group
    world, rank = g.size, g.rank
    big = 3 * shm.region_bytes(world) // 4 + 1001  # float32 elements: 3 regions' worth and an odd tail
    gen = torch.Generator().manual_seed(rank)
    mine = torch.randn(big, generator=gen)
    every = [torch.randn(big, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    t = mine.clone()
    comm.all_reduce(t, g)
    expect = every[0].clone()
    for x in every[1:]:
        expect.add_(x)  # rank order, as the transport sums
    torch.testing.assert_close(t, expect, rtol=0, atol=0)
    rows = torch.stack([mine * (c + 1) for c in range(world)]).view(-1)
    out = torch.empty(big)
    comm.reduce_scatter(out, rows, g, op="avg")
    expect = torch.stack([x * (rank + 1) for x in every]).sum(0) / world
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
    gathered = torch.empty(world * big)
    comm.all_gather(gathered, mine, g)
    torch.testing.assert_close(gathered, torch.cat(every), rtol=0, atol=0)
    b = mine.clone()
    comm.broadcast(b, world - 1, g)
    torch.testing.assert_close(b, every[-1], rtol=0, atol=0)
    if rank == 0:  # the mapping's file was unlinked once every rank had mapped it: a crash leaves nothing
        assert not glob.glob(os.path.join(shm._DIR, f"pyparallel-{os.getpid()}-*"))
    return bool(g.arena) and g.arena.rounds > 4 * 3


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_in_rounds(world):
    assert run(chunked_body, world, env={"PYPARALLEL_SHM": "1"}) == [True] * world


def accounting_body():
    mesh = pyparallel.init()
    g, n = mesh.world_group, mesh.world_size
    pyparallel.reset_comm_stats()
    comm.all_reduce(torch.zeros(1000), g)  # 4000 bytes
    comm.all_gather(torch.zeros(100 * n), torch.zeros(100), g)  # output 400n bytes
    f64 = torch.float64
    comm.reduce_scatter(torch.zeros(10, dtype=f64), torch.zeros(10 * n, dtype=f64), g)  # input 80n bytes
    comm.broadcast(torch.zeros(3, dtype=torch.int64), 0, g)  # 24 bytes
    return pyparallel.comm_stats()


@pytest.mark.parametrize("world", [2, 4])
def test_byte_accounting(world):
    stats = run(accounting_body, world)[0]
    f = (world - 1) / world
    by = stats["by_op"]
    assert by["all_reduce"] == {"calls": 1, "payload_bytes": 4000, "wire_bytes": round(4000 * 2 * f)}
    assert by["all_gather"] == {"calls": 1, "payload_bytes": 400 * world, "wire_bytes": round(400 * world * f)}
    assert by["reduce_scatter"] == {"calls": 1, "payload_bytes": 80 * world,
                                    "wire_bytes": round(80 * world * f)}
    assert by["broadcast"] == {"calls": 1, "payload_bytes": 24, "wire_bytes": 24}
    assert stats["by_axis"]["world"]["calls"] == 4
    assert stats["by_op_axis"]["all_reduce@world"]["payload_bytes"] == 4000
    assert stats["total"]["payload_bytes"] == 4000 + 480 * world + 24


def wrong_size_body():
    mesh = pyparallel.init()
    with pytest.raises(ValueError, match="expected 2 x 3"):
        comm.all_gather(torch.zeros(5), torch.zeros(3), mesh.world_group)
    with pytest.raises(ValueError, match="dtype"):
        comm.reduce_scatter(torch.zeros(3), torch.zeros(6, dtype=torch.float64), mesh.world_group)
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.all_reduce(torch.zeros(2), mesh.world_group, op="mean")
    return True


def test_bad_arguments_fail_before_communicating():
    assert run(wrong_size_body, 2) == [True, True]


def receive_arrival_body():
    mesh = pyparallel.init()
    g = mesh.world_group
    if g.rank == 0:
        comm.send(torch.arange(5.0), 1, g)
        comm.barrier(g)
        return True
    buf = torch.zeros(5)
    h = comm.recv(buf, 0, g, async_op=True)
    comm.barrier(g)  # the send has completed
    deadline = time.monotonic() + 30
    while not h.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    seen = h.is_completed()
    h.wait()
    return seen and torch.equal(buf, torch.arange(5.0))


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_receive_reports_its_arrival_without_being_waited_for(transport):
    """An async receive says it has completed once its message is there, before anyone calls wait(): the
    pipeline runs a deferred W instead of blocking only while a message is missing (gloo itself marks a
    receive complete only inside wait(), so comm.py has a thread wait for it)."""
    assert run(receive_arrival_body, 2, env={"PYPARALLEL_SHM": "1" if transport == "shm" else "0"}) == [True, True]


def _message(k: int, sender: int):
    """Message k from ``sender``: dtypes, shapes and sizes that cover the channel's cases -- empty, one
    element, an odd tail, several slots, more than the whole ring (so its sender's writer thread finishes
    it while the receiver copies out), a 0-d tensor, bool."""
    slot = shm.slot_bytes()
    sizes = [0, 1, 1001, slot // 4 + 3, 3 * slot // 4 + 5, (shm.SLOTS + 2) * slot // 4 + 7]
    dtype = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float64][k % 5]
    n = sizes[k % len(sizes)]
    if dtype == torch.bool:
        return (torch.arange(n) % (3 + sender) == 0).view(-1)
    if k % 7 == 6:
        return torch.tensor(float(k + sender), dtype=dtype)  # 0-d
    return (torch.arange(n) * (sender + 1) + k).to(dtype)


def p2p_body(messages: int):
    """Both ranks of a two-rank group send each other ``messages`` messages at once, every send issued
    before any receive is waited for (a full ring must not block a send), some into non-contiguous
    buffers; the ranks then receive them in order and compare."""
    mesh = pyparallel.init()
    g = mesh.world_group
    peer = 1 - g.rank
    sends = []
    for k in range(messages):
        t = _message(k, g.rank)
        if k % 4 == 3 and t.dim() == 1 and t.numel() > 1:
            t = torch.stack([t, t]).t()[:, 0]  # a non-contiguous send
        sends.append((t, comm.send(t, peer, g, async_op=True)))
    for k in range(messages):
        want = _message(k, peer)
        if k % 4 == 1 and want.dim() == 1 and want.numel() > 1:
            holder = torch.zeros(2, want.numel(), dtype=want.dtype)
            buf = holder.t()[:, 1]  # a non-contiguous receive buffer
        else:
            buf = torch.zeros_like(want)
        h = comm.recv(buf, peer, g, async_op=k % 2 == 0)
        if h is not None:
            h.wait()
        assert torch.equal(buf, want), f"message {k}: {buf} != {want}"
    for _, h in sends:
        h.wait()
        assert h.is_completed()
    comm.barrier(g)
    return g.channel not in (None, False)


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_point_to_point_in_order_without_blocking_a_send(transport):
    env = {"PYPARALLEL_SHM": "1" if transport == "shm" else "0"}
    assert run(p2p_body, 2, 30, env=env) == [transport == "shm"] * 2


@pytest.mark.skipif(not _ops.has_kernel("shm_wait", torch.device("cpu")), reason="extension not built")
def test_shared_memory_counters():
    """csrc/cpu/shm_flags.cpp in one process: a wait returns -1 once every counter reached the value, else
    the first rank behind when its timeout ends; bad flags tensors are refused."""
    flags = torch.zeros(3, 8, dtype=torch.int64)
    ops = torch.ops.pyparallel
    for r in range(3):
        ops.shm_post(flags, r, 5)
    assert ops.shm_wait(flags, 5, 1.0) == -1 and ops.shm_wait(flags, 4, 0.0) == -1
    ops.shm_post(flags, 2, 7)
    ops.shm_post(flags, 0, 7)
    start = time.monotonic()
    assert ops.shm_wait(flags, 6, 0.05) == 1  # rank 1 still at 5
    assert 0.04 < time.monotonic() - start < 5
    assert flags[:, 0].tolist() == [7, 5, 7] and int(flags[:, 1:].abs().sum()) == 0
    with pytest.raises(RuntimeError, match="int64"):
        ops.shm_wait(torch.zeros(3, 8), 1, 0.0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.shm_post(flags, 3, 1)
