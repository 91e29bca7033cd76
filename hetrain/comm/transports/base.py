"""The transport's base class (what a transport offers its staging and the engine) and
the server leg shared by the server and hierarchical transports."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Literal

from .. import p2p
from ..cargo import Cargo
from ..protocol import part_tag
from ..shm.select import channels_for
from ..window import CreditWindow

Arrival = Literal["forward", "backward"]  # the order in which a step's pieces are handed over


class Transport:
    direct = False  # staging: from the user's tensors (True) or through a work buffer
    # progress() has work of its own to poll now (collectives in flight that complete
    # asynchronously), not only the partitions a tensor completes: kept current by the
    # transport, read by the engine at every tensor handed over
    polls = False
    # how a worker's gradients are weighted (comm/worker/step.py `weigh`): it scales its own
    # share b_i / Σb (an all-reduce among workers), or the servers weight each machine's
    # push by its batch (the machine's workers add b_l·g_l first: `machine_sum`)
    weighs_itself = False
    machine_sum = False

    def __init__(self, ctx):
        self.ctx = ctx
        self.t_first: float | None = None
        self.t_last = 0.0
        self.bytes_out = 0
        self.bytes_in = 0

    def begin(self, staging, epoch: int, overlapped: bool, arrival: Arrival | None = None) -> None:
        self.staging = staging
        self.layout = staging.layout
        self.epoch = epoch
        self.overlapped = overlapped
        self.arrival = arrival
        self.t_first, self.t_last = None, 0.0
        self.bytes_out = self.bytes_in = 0

    def backward_order(self) -> bool:
        """Collectives and sends go in backward order (last layers first) when the pieces
        arrive that way: gradient hooks (an overlapped step, or the job's --overlap),
        unless the caller says they arrive front to back (DDP's buckets of a flat buffer).
        Every worker makes the same calls, so every worker picks the same order."""
        if self.arrival is not None:
            return self.arrival == "backward"
        return self.ctx.comm.overlap or self.overlapped

    def _touch(self) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()

    def filled(self, pids: list[int]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def progress(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def finish(self, idle: Callable[[], None] | None = None) -> None:  # pragma: no cover - interface
        """Send what is left and wait for every result. `idle`: work of the caller's that
        may run once everything is on its way, before the wait (where a transport has
        such a point; the others ignore it)."""
        raise NotImplementedError

    def carry(self, row) -> Cargo | None:
        """A few numbers per worker to ride the next step's exchange (comm/cargo.py); None
        where this transport cannot carry them (the caller then gathers them itself)."""
        return None


class ServerLeg:
    """Posting partitions to the summation servers and retiring their sums (shared by the
    server and the hierarchical transports)."""

    def __init__(self, transport: Transport, window: CreditWindow, sort_reverse: bool):
        self.t = transport
        self.ctx = transport.ctx
        self.servers = [p.rank for p in self.ctx.topology.servers]
        chans = channels_for(self.ctx, self.servers)  # shared memory to a server on this host, else gloo
        self.channels = [chans[r] for r in self.servers]
        self.window = window
        self.sort_reverse = sort_reverse
        self.pending: list[int] = []
        self.inflight: dict[int, deque] = {}

    def add(self, pids) -> None:
        self.pending.extend(pids)

    def flush(self, block: bool) -> None:
        """Post pending partitions in priority order while the window allows; with
        block=False never wait (called from backward), with block=True wait as needed."""
        layout = self.t.layout
        self.pending.sort(reverse=self.sort_reverse)
        while self.pending:
            pid = self.pending[0]
            srv = layout.parts[pid].server
            while not self.window.admits(srv, layout.sizes[pid]):
                if not block:
                    return
                victim = self.window.victim(srv)
                if victim is None:
                    victim = min((q[0][0], s) for s, q in self.inflight.items() if q)[1]
                self.retire(self.inflight[victim].popleft())
            self.pending.pop(0)
            self.post(pid)

    def post(self, pid: int) -> None:
        t = self.t
        p = t.layout.parts[pid]
        dst = self.servers[p.server]
        sbuf, rbuf = t.staging.views(pid)
        t._touch()
        g = self.ctx.lane(p.lane)
        self.ctx.pace(dst, sbuf.numel() * sbuf.element_size())
        tag = part_tag(t.epoch, p.pid)
        chan = self.channels[p.server]
        s = chan.isend(sbuf, tag, g, what=f"sending partition {pid}")
        r = chan.irecv(rbuf, tag, g, what=f"receiving the sum of partition {pid}")
        self.inflight.setdefault(p.server, deque()).append((pid, dst, s, r))
        self.window.sent(p.server, t.layout.sizes[pid])

    def retire(self, item) -> int:
        pid, dst, s, r = item
        p2p.wait(s, self.ctx.peer_error, f"sending partition {pid}", [dst])
        p2p.wait(r, self.ctx.peer_error, f"waiting for the sum of partition {pid}", [dst])
        t = self.t
        t.t_last = time.perf_counter()
        n = t.layout.sizes[pid]
        self.window.done(t.layout.parts[pid].server, n)
        t.bytes_out += n
        t.bytes_in += n
        t.staging.stage_in(pid)
        return pid

    def retire_done(self) -> list[int]:
        """Retire the partitions whose sums are in, without blocking."""
        out = []
        for q in self.inflight.values():
            while q and q[0][3].is_completed() and q[0][2].is_completed():
                out.append(self.retire(q.popleft()))
        return out

    def retire_oldest(self) -> int | None:
        qs = [(q[0][0], s) for s, q in self.inflight.items() if q]
        if not qs:
            return None
        return self.retire(self.inflight[min(qs)[1]].popleft())

    def drain(self) -> list[int]:
        out = []
        for q in self.inflight.values():
            while q:
                out.append(self.retire(q.popleft()))
        return out

    @property
    def busy(self) -> bool:
        return bool(self.pending) or any(self.inflight.values())
