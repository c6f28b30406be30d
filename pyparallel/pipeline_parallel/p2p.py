"""Point-to-point traffic between pipeline stages: activations forward, gradients backward.

Deadlock freedom comes from one rule, not from pairing sends with receives by hand: **no stage ever
blocks on a send**. Every send is issued asynchronously the moment its tensor is computed and only
waited for at the end of the step; a stage blocks only on a receive whose data it needs now. The
matching send is then already issued or will be issued by a peer that is not waiting on us (the
schedule is a valid order of the compute dependencies, which ``schedules.simulate`` checks), so both
neighbours sending at once, or the last micro-batch, cannot deadlock.

Each direction of each neighbouring pair has its own two-rank group (sender first), so a group carries
one sender's messages only. Messages are matched first-in first-out, and each receiver posts its receives
in exactly the order the sender will send (``schedules.messages_from``), one message ahead of need so the
transfer overlaps compute. The separate groups matter on NCCL, which runs a group's point-to-point
operations on one stream in issue order: with both directions on one stream, a receive queued before a
send that the peer is waiting for would deadlock the pair; with one direction per stream the queue holds
only sends on one side and the matching receives, in the same order, on the other.

Sizes travel in a handshake: before the first activation of each step that crosses a boundary the
sender sends a fixed-size ``meta`` (dtype, requires-grad, shape), so micro-batches may change sequence
length between steps. The gradient of an activation has the
activation's shape, which the receiver of the gradient sent itself.

Every wait goes through a ``comm.Handle``: a peer that dies or stops mid-step surfaces here as
``CollectiveError``/``CollectiveTimeoutError`` within the group's timeout instead of a hang.
"""

from __future__ import annotations

import time

import torch

from pyparallel import comm

META_LEN = 16
_MAX_DIMS = META_LEN - 3
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn,
           torch.float8_e5m2]


def encode_meta(t: torch.Tensor) -> torch.Tensor:
    """[dtype code, requires_grad, ndim, *shape] as int64, padded to META_LEN."""
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"pipeline activations may have at most {_MAX_DIMS} dimensions, got shape "
                         f"{tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"pipeline activations of dtype {t.dtype} are not supported")
    meta = [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    return torch.tensor(meta + [0] * (META_LEN - len(meta)), dtype=torch.int64)


def decode_meta(meta: torch.Tensor) -> tuple[torch.Size, torch.dtype, bool]:
    vals = meta.tolist()
    ndim = vals[2]
    return torch.Size(vals[3:3 + ndim]), _DTYPES[vals[0]], bool(vals[1])


class _Incoming:
    """The receives from one peer, in that peer's send order."""

    def __init__(self, peer: int, expected: list[tuple]):
        self.peer = peer
        self.expected = expected
        self.index = {key: i for i, key in enumerate(expected)}
        self.posted = 0  # receives [0, posted) are issued
        # One past the furthest message taken, or skipped: a gradient that never comes (``_post_one``) is
        # passed over as soon as it is known not to come, since nobody takes it.
        self.frontier = 0
        self.slots: dict[int, tuple[torch.Tensor, comm.Handle]] = {}  # posted, not yet taken
        # data[j]: data (non-meta) messages before j. Receives run ahead of need by one data message
        # (plus the handshakes before it): enough to overlap the transfer with compute, while 1F1B's
        # bound on live activations still holds.
        self.data = [0]
        for key in expected:
            self.data.append(self.data[-1] + (key[0] != "meta"))

    def limit(self) -> int:
        """One past the last index that may be posted now."""
        j = self.posted
        while j < len(self.expected) and self.data[j] <= self.data[min(self.frontier, len(self.expected))]:
            j += 1
        return j


class Links:
    """One step's point-to-point traffic of one stage.

    ``groups[(src, dst)]`` is the two-rank group (src first) carrying messages from pipeline rank ``src``
    to ``dst``; ``expected[peer]`` is the message list ``peer`` will send us
    (``schedules.messages_from``). ``wait_s`` accumulates the time spent blocked on messages (the
    stage's idle time).
    """

    def __init__(self, groups: dict[tuple[int, int], comm.Group], rank: int, expected: dict[int, list[tuple]],
                 device: torch.device, expected_shapes: dict[int, tuple] | None = None):
        self.groups = groups
        self.rank = rank
        self.device = device
        self.incoming = {peer: _Incoming(peer, msgs) for peer, msgs in expected.items() if msgs}
        self.act_meta: dict[int, tuple[torch.Size, torch.dtype, bool]] = {}  # boundary -> received meta
        self.sent_meta: dict[int, tuple[torch.Size, torch.dtype, bool]] = {}  # boundary -> what we sent
        self.expected_shapes = expected_shapes or {}
        self.sends: list[comm.Handle] = []
        self.keep: list[torch.Tensor] = []  # tensors of in-flight sends (must outlive the send)
        self.wait_s = 0.0
        for inc in self.incoming.values():
            self._post_ready(inc)

    # ------------------------------------------------------------------------------------- send

    def send_act(self, boundary: int, t: torch.Tensor, peer: int) -> None:
        if boundary not in self.sent_meta:
            meta = encode_meta(t)
            self.sent_meta[boundary] = decode_meta(meta)
            self._send(meta.to(self.device), peer)
        self._send(t.detach(), peer)

    def send_grad(self, t: torch.Tensor, peer: int) -> None:
        self._send(t, peer)

    def _send(self, t: torch.Tensor, peer: int) -> None:
        t = t.contiguous()
        self.sends.append(comm.send(t, 1, self.groups[(self.rank, peer)], async_op=True))
        self.keep.append(t)
        if len(self.sends) > 8:  # release finished sends' buffers without ever blocking on them
            live = []
            for h, k in zip(self.sends, self.keep):
                if h.is_completed():
                    h.wait()  # returns at once; raises if the send failed
                else:
                    live.append((h, k))
            self.sends, self.keep = [h for h, _ in live], [k for _, k in live]

    # ---------------------------------------------------------------------------------- receive

    def take(self, peer: int, key: tuple) -> torch.Tensor:
        """Block until message ``key`` from ``peer`` has arrived and return it (timed as idle)."""
        inc = self.incoming[peer]
        i = inc.index[key]
        start = time.perf_counter()
        self._post_upto(inc, i)
        buf, handle = inc.slots.pop(i)
        handle.wait()
        inc.frontier = max(inc.frontier, i + 1)
        self._post_ready(inc)  # keep the next message's receive in flight
        self.wait_s += time.perf_counter() - start
        return buf

    def ready(self, peer: int, key: tuple) -> bool:
        """Whether message ``key`` from ``peer`` has arrived (never blocks): a zero-bubble stage runs a
        deferred W instead of waiting when it has not."""
        inc = self.incoming[peer]
        i = inc.index[key]
        if i >= inc.posted:
            self._post_ready(inc)
            if i >= inc.posted:
                return False
        slot = inc.slots.get(i)
        return slot is None or slot[1].is_completed()

    def progress(self) -> None:
        """Post receives whose sizes became known, without blocking (called between compute)."""
        for inc in self.incoming.values():
            self._post_ready(inc)

    def _shape_of(self, inc: _Incoming, key: tuple, block: bool):
        """Size of message ``key``, or None when it depends on a handshake that has not arrived."""
        if key[0] == "meta":
            return torch.Size([META_LEN]), torch.int64
        boundary = key[1]
        if key[0] == "grad":
            shape, dtype, _ = self.sent_meta[boundary]
            return shape, dtype
        if boundary not in self.act_meta:
            j = inc.index[("meta", boundary)]
            slot = inc.slots.get(j)
            if slot is None or not (block or slot[1].is_completed()):
                return None
            slot[1].wait()
            del inc.slots[j]
            self._accept_meta(boundary, slot[0])
        shape, dtype, _ = self.act_meta[boundary]
        return shape, dtype

    def _accept_meta(self, boundary: int, meta: torch.Tensor) -> None:
        shape, dtype, rg = decode_meta(meta.cpu())
        want = self.expected_shapes.get(boundary)
        if want is not None and (tuple(shape), dtype) != (tuple(want[0]), want[1]):
            raise ValueError(f"pipeline boundary {boundary}: the previous stage sent an activation of shape "
                             f"{tuple(shape)} ({dtype}) but shape inference expected {tuple(want[0])} "
                             f"({want[1]}); the chunk's output shape depends on its data")
        self.act_meta[boundary] = (shape, dtype, rg)

    def _post_one(self, inc: _Incoming, block: bool) -> bool:
        key = inc.expected[inc.posted]
        if key[0] == "grad" and key[1] not in self.sent_meta:
            # We have not sent that boundary's activations yet, so its size is unknown here; a gradient
            # never arrives before its activation left, so blocking cannot reach this point.
            assert not block, f"gradient {key} expected before its activation was sent"
            return False
        if key[0] == "grad" and not self.sent_meta[key[1]][2]:
            # The activation needed no gradient (a frozen first chunk's output): no message comes back, and
            # the stage does not ask for one (its B takes nothing), so the slot is passed over here. It must
            # not hold the window (``limit``) either: the window moves only as messages are taken, so the
            # slots after it -- the last of them at least -- would never be posted.
            inc.posted += 1
            inc.frontier = max(inc.frontier, inc.posted)
            return True
        size = self._shape_of(inc, key, block)
        if size is None:
            return False
        buf = torch.empty(size[0], dtype=size[1], device=self.device)
        group = self.groups[(inc.peer, self.rank)]
        inc.slots[inc.posted] = (buf, comm.recv(buf, 0, group, async_op=True))
        inc.posted += 1
        return True

    def _post_upto(self, inc: _Incoming, i: int) -> None:
        while inc.posted <= i:
            self._post_one(inc, block=True)

    def _post_ready(self, inc: _Incoming) -> None:
        """Post the receives the window allows, stopping at one whose size is not yet known."""
        n = inc.limit()
        while inc.posted < n and self._post_one(inc, block=False):
            pass

    # ------------------------------------------------------------------------------------ finish

    def finish(self) -> None:
        """Wait for every send of the step (their receivers have all been posted by now)."""
        start = time.perf_counter()
        for h in self.sends:
            h.wait()
        self.sends.clear()
        self.keep.clear()
        for inc in self.incoming.values():
            if inc.posted != len(inc.expected) or inc.slots:
                raise RuntimeError(f"pipeline: messages from stage {inc.peer} left unconsumed at the end "
                                   f"of the step ({inc.posted}/{len(inc.expected)} posted)")
        self.wait_s += time.perf_counter() - start
