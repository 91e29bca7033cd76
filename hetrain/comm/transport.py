"""Transports: how a worker moves the partitions of one push_pull. Chosen once per job
(`make_transport`), never re-decided per call:

- `ServerTransport`: push each partition to its summation server and pull the sum back
  (gloo point-to-point), under the credit window (comm/window.py).
- `AllReduceTransport`: all-reduce buckets among the workers, asynchronously, each as
  soon as it is complete and the ones before it (in a fixed order) are launched: NCCL for
  CUDA tensors when every worker has a GPU of its own, gloo otherwise.
- `HierarchicalTransport`: for a machine with several workers (`gpus: N`). The local
  workers first reduce each partition to the one that owns it (balanced bytes,
  comm/flatlayout.py), the owner pushes it to the servers and pulls the sum, and the local
  workers broadcast it from the owner (BytePS's and Horovod's hierarchical scheme; a
  reduce and a broadcast per partition, which is a reduce-scatter and an all-gather with
  uneven pieces). The local group is a parameter: NCCL between a machine's GPUs, gloo for
  emulated devices (how CPU tests run it) and for host tensors. Every worker of a machine
  issues its collectives in one global order, all reduces then all broadcasts (as BytePS
  fixes one order for its NCCL calls), so no two workers interleave them differently. The servers see one pusher per machine and
  weight it as the sum of its workers' pre-scaled gradients (comm/protocol.py), so the
  result stays the batch-weighted average.

A transport works on a step's staging (comm/staging.py, comm/cuda.py), which owns the
buffers; `progress()` never blocks (called from gradient hooks), `finish()` does.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch.distributed as dist

from . import p2p
from .buckets import DDP_CAPS, BucketCaps
from .cargo import CARGO_ROOM, Cargo, CargoHold
from .layout import Manifest
from .partition import Partition, plan_for
from .protocol import part_tag
from .window import CreditWindow

Arrival = Literal["forward", "backward"]  # the order in which a step's pieces are handed over


class Transport:
    direct = False  # staging: from the user's tensors (True) or through a work buffer

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
        s = p2p.isend(sbuf, dst, tag, g, what=f"sending partition {pid}")
        r = p2p.irecv(rbuf, dst, tag, g, what=f"receiving the sum of partition {pid}")
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


class ServerTransport(Transport):
    """One worker per machine: every partition straight to its summation server."""

    direct = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.shares = np.array([p.share for p in ctx.topology.servers])
        # --overlap without --credit-bytes: post in backward order, no window (servers sum in that order)
        self.job_unlimited = ctx.comm.overlap and not ctx.comm.credit_bytes

    def partitions(self, manifest: Manifest) -> list[Partition]:
        c = self.ctx.comm
        return plan_for(self.shares, manifest.numel, c.partition_bytes, c.max_lanes)

    def begin(self, staging, epoch: int, overlapped: bool, arrival: Arrival | None = None) -> None:
        super().begin(staging, epoch, overlapped, arrival)
        c = self.ctx.comm
        window = CreditWindow.for_job(c.partition_bytes, c.credit_bytes, self.job_unlimited or overlapped)
        self.leg = ServerLeg(self, window, sort_reverse=self.job_unlimited)

    def filled(self, pids: list[int]) -> None:
        for pid in pids:
            self.staging.stage_out(pid)

    def progress(self) -> None:
        self.leg.add(self.staging.out_ready(False))
        self.leg.flush(block=False)

    def finish(self, idle: Callable[[], None] | None = None) -> None:
        while self.staging.outstanding:
            self.leg.add(self.staging.out_ready(True))
            self.leg.flush(block=True)
        self.leg.add(self.staging.out_ready(False))
        self.leg.flush(block=True)
        self.leg.drain()


class AllReduceTransport(Transport):
    """Buckets all-reduced among the workers as soon as they are complete, in a fixed
    order (every worker must issue collectives in the same order). The workers are the
    job's, or a subgroup's (`group`, a `comm.group.Group`: a pipeline stage's replicas).

    Two members with host buffers swap small buckets instead (`p2p.Swap`: one round, not
    gloo's two), up to `SWAP_BUCKET_BYTES` a bucket and `SWAP_SCRATCH_BYTES` of receive
    buffers in all; larger buckets are bandwidth-bound and keep gloo's ring."""

    SWAP_BUCKET_BYTES = 1 << 20
    SWAP_SCRATCH_BYTES = 8 << 20

    def __init__(self, ctx, group=None):
        super().__init__(ctx)
        self._group = group
        self.caps: BucketCaps = DDP_CAPS  # the engine's bucket tuner may change it (comm/buckets.py)
        self._scratch: dict[int, object] = {}  # receive buffers of swapped buckets, for `_scratch_layout`
        self._scratch_layout = None
        self.hold = CargoHold()  # numbers to ride the next step's smallest bucket (`carry`)

    @property
    def members(self):
        """The group all-reduced over (the job's workers unless a subgroup was given)."""
        if self._group is None:
            from .group import job_group

            self._group = job_group(self.ctx)
        return self._group

    def partitions(self, manifest: Manifest) -> list[Partition]:
        """Buckets of `caps` (comm/partition.py `plan_buckets`; DDP's by default: a small
        first bucket, then 25 MiB), cut at whole tensors in backward order. The same on
        every worker whatever its device, overlap or not (a function of the model and of
        caps every worker agreed on), so a GPU worker and a CPU worker issue the same
        collectives."""
        return self.caps.plan([e.numel for e in manifest.entries])

    @property
    def _what(self) -> str:
        g = self.members
        return "all-reducing gradients" + ("" if g.whole_job else f" among {g.describe()}")

    @property
    def _peers(self) -> list[int]:
        """Whom to blame for a failed collective when the launcher has not named a dead
        rank: a subgroup's other members (the job's workers: found by who is stuck)."""
        g = self.members
        return [] if g.whole_job else [r for r in g.ranks if r != self.ctx.rank]

    def begin(self, staging, epoch: int, overlapped: bool, arrival: Arrival | None = None) -> None:
        super().begin(staging, epoch, overlapped, arrival)
        self.order = self.layout.order(self.backward_order())
        self.next = 0
        self.ready: set[int] = set()
        self.works: deque = deque()
        self.group = self.members.nccl if staging.on_device else self.members.gloo
        if self._scratch_layout is not self.layout:  # new buckets: new receive buffers
            self._scratch, self._scratch_layout = {}, self.layout
            if self.members.size == 2:
                room = self.SWAP_SCRATCH_BYTES
                for pid, part in enumerate(self.layout.parts):
                    if part.length * 4 <= min(self.SWAP_BUCKET_BYTES, room):
                        self._scratch[pid] = None  # allocated at its first swap
                        room -= part.length * 4

    def filled(self, pids: list[int]) -> None:
        pass

    def carry(self, row) -> Cargo | None:
        """`row` rides the next step's smallest bucket (comm/cargo.py) in the job's
        all-reduce over gloo (host buffers, whole job: a slot per worker, in worker order).
        None where it cannot (NCCL's device buffers, a subgroup, one worker, before the
        first step, no bucket small enough to copy): the caller then gathers the rows."""
        g, st = self.members, getattr(self, "staging", None)
        if not g.whole_job or g.size < 2 or st is None or st.on_device:
            return None
        return self.hold.attach(row, sorted(g.ranks).index(self.ctx.rank), g.size, st)

    def _start(self, pid: int, view):
        """The bucket's all-reduce, as a swap with the other member where it qualifies (a
        small bucket in host memory: device buffers go to NCCL's all-reduce)."""
        sent = view if self.hold.pending is None else self.hold.load(pid, view, self.staging)  # + a cargo's trailer
        if pid not in self._scratch or self.staging.on_device:
            return dist.all_reduce(sent, group=self.group, async_op=True)
        if self._scratch[pid] is None:  # with room for a cargo's trailer
            self._scratch[pid] = view.new_empty(view.numel() + CARGO_ROOM)
        scratch = self._scratch[pid][:sent.numel()]
        me = self.ctx.rank
        peer = next(r for r in self.members.ranks if r != me)
        return p2p.Swap(sent, scratch, peer, p2p.PAIR(pid % p2p.PAIR.size), self.group, f"swapping bucket {pid}")

    def _launch(self) -> None:
        while self.next < len(self.order) and self.order[self.next] in self.ready:
            pid = self.order[self.next]
            view = self.staging.work_view(pid)
            if not self.staging.on_device:
                p2p.host_only(view, f"all-reducing bucket {pid} over gloo")
            if self.ctx.bucket is not None:  # a ring moves 2(n-1)/n of the buffer through each uplink
                n = self.members.size
                self.ctx.bucket.consume(int(2 * (n - 1) / n * view.numel() * 4))
            self._touch()
            try:
                work = self._start(pid, view)
            except RuntimeError as err:
                raise self.ctx.peer_error(self._what, self._peers, err) from None
            self.works.append((pid, work))
            self.next += 1

    def progress(self) -> None:
        self.ready.update(self.staging.work_ready(False))
        self._launch()

    def finish(self, idle: Callable[[], None] | None = None) -> None:
        while self.next < len(self.order):
            self.ready.update(self.staging.work_ready(True))
            self._launch()
        if idle is not None:  # every bucket is on its way: the caller's work runs in the wait
            idle()
        while self.works:
            pid, work = self.works.popleft()
            p2p.wait(work, self.ctx.peer_error, self._what, self._peers)
            self.hold.unload(pid)
            self.staging.deliver(pid)
            n = self.layout.parts[pid].length * 4
            self.bytes_out += n
            self.bytes_in += n
        self.t_last = time.perf_counter()


class HierarchicalTransport(Transport):
    """Several workers on one machine: local reduce -> owner push/pull -> local broadcast,
    per partition, pipelined (see the module docstring)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.shares = np.array([p.share for p in ctx.topology.servers])
        self.local = list(ctx.local_ranks)

    def partitions(self, manifest: Manifest) -> list[Partition]:
        c = self.ctx.comm
        return plan_for(self.shares, manifest.numel, c.partition_bytes, c.max_lanes)

    def begin(self, staging, epoch: int, overlapped: bool, arrival: Arrival | None = None) -> None:
        super().begin(staging, epoch, overlapped, arrival)
        layout = self.layout
        # device buffers over the machine's NCCL pair; host ones over its gloo pair (the NCCL
        # communicators take CUDA tensors only)
        pair = self.ctx.local_groups if staging.on_device else self.ctx.local_host_groups
        self.reduce_group, self.bcast_group = pair
        self.order = layout.order(self.backward_order())
        self.owner = {pid: self.local[layout.owner(pid, len(self.local))] for pid in range(len(layout.parts))}
        me = self.ctx.rank
        self.mine = {pid for pid, r in self.owner.items() if r == me}
        # no window: an owner posts every partition as soon as it is reduced, so no owner
        # ever waits for a sum while holding back a partition another one waits for
        self.leg = ServerLeg(self, CreditWindow(0, 1, unlimited=True), sort_reverse=self.backward_order())
        self.ready: set[int] = set()  # work buffer complete
        self.next_reduce = 0
        self.reduces: deque = deque()  # (pid, work) in order
        self.summed: set[int] = set()  # the machine's sum (owner: the global sum) is in the work buffer
        self.next_bcast = 0
        self.bcasts: deque = deque()
        self.delivered = 0

    def filled(self, pids: list[int]) -> None:
        pass

    def _collective(self, what: str, fn, view, **kw):
        if not self.staging.on_device:
            p2p.host_only(view, what)
        try:
            return fn(view, async_op=True, **kw)
        except RuntimeError as err:
            raise self.ctx.peer_error(what, [r for r in self.local if r != self.ctx.rank], err) from None

    def _step(self, block: bool) -> bool:
        """One pass over the pipeline; returns whether anything moved."""
        moved = False
        st = self.staging
        self.ready.update(st.work_ready(False))
        # 1. local reduces, in the fixed order, each to the partition's owner
        while self.next_reduce < len(self.order) and self.order[self.next_reduce] in self.ready:
            pid = self.order[self.next_reduce]
            self._touch()
            w = self._collective(f"reducing partition {pid} among the machine's workers", dist.reduce,
                                 st.work_view(pid), dst=self.owner[pid], group=self.reduce_group)
            self.reduces.append((pid, w))
            self.next_reduce += 1
            moved = True
        # 2. reduced: the owner pushes it to the servers; the others wait for the broadcast
        while self.reduces and (block or self.reduces[0][1].is_completed()):
            pid, w = self.reduces.popleft()
            p2p.wait(w, self.ctx.peer_error, f"reducing partition {pid} among the machine's workers",
                     [r for r in self.local if r != self.ctx.rank])
            if pid in self.mine:
                st.stage_out(pid)
            else:
                self.summed.add(pid)
            moved = True
            block = False
        # 3. the owner's server leg
        out = st.out_ready(False)
        if out:
            self.leg.add(out)
            self.leg.flush(block=False)
            moved = True
        done = self.leg.retire_done()
        if done:
            self.summed.update(done)
            moved = True
        # 4. local broadcasts from the owners, in the fixed order, once every reduce is issued:
        # every worker then issues the same sequence over both communicators (all reduces, then
        # all broadcasts), never an interleaving that depends on when sums come back, which
        # can deadlock NCCL where the GPU serialises its queues (CUDA_DEVICE_MAX_CONNECTIONS=1)
        while (self.next_reduce == len(self.order) and self.next_bcast < len(self.order)
               and self.order[self.next_bcast] in self.summed):
            pid = self.order[self.next_bcast]
            ev = st.in_event(pid)
            if ev is not None:  # NCCL: the broadcast runs after the sum's host-to-device copy
                st.cuda.compute().wait_event(ev)
            w = self._collective(f"broadcasting partition {pid} from its owner", dist.broadcast,
                                 st.work_view(pid), src=self.owner[pid], group=self.bcast_group)
            self.bcasts.append((pid, w))
            self.next_bcast += 1
            moved = True
        # 5. broadcast done: the result goes to the user's tensors
        while self.bcasts and self.bcasts[0][1].is_completed():
            self._deliver(*self.bcasts.popleft())
            moved = True
        return moved

    def _deliver(self, pid: int, w) -> None:
        p2p.wait(w, self.ctx.peer_error, f"broadcasting partition {pid} from its owner", [self.owner[pid]])
        self.staging.deliver(pid)
        self.delivered += 1
        self.t_last = time.perf_counter()

    def progress(self) -> None:
        self._step(block=False)

    def finish(self, idle: Callable[[], None] | None = None) -> None:
        total = len(self.layout.parts)
        while self.delivered < total:
            if self._step(block=False):
                continue
            # nothing moved: wait for the oldest thing in flight, in pipeline order (every
            # worker has issued everything it can, so whatever is oldest will complete)
            if self.next_reduce < len(self.order):
                self.ready.update(self.staging.work_ready(True))
            elif self.reduces:
                self._step(block=True)
            elif self.staging.outstanding:
                self.leg.add(self.staging.out_ready(True))
                self.leg.flush(block=True)
            elif any(self.leg.inflight.values()):
                self.summed.add(self.leg.retire_oldest())
            elif self.bcasts:
                self._deliver(*self.bcasts.popleft())
            else:  # pragma: no cover - a pipeline that cannot move is a bug
                raise RuntimeError(f"hierarchical push_pull stalled at {self.delivered} of {total} partitions")


def make_transport(ctx, group=None) -> Transport:
    """The job's transport for this worker, decided once from the topology; a subgroup
    (`group`) always all-reduces among its members."""
    if group is not None:
        return AllReduceTransport(ctx, group)
    if not ctx.topology or not ctx.topology.servers:
        return AllReduceTransport(ctx)
    if ctx.local_groups is not None:
        return HierarchicalTransport(ctx)
    return ServerTransport(ctx)
