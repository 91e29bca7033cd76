"""`AllReduceTransport`: buckets all-reduced among the workers (gloo, NCCL, or shared
memory among the processes of one host: transports/collective.py)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from .. import p2p
from ..buckets import DDP_CAPS, BucketCaps
from ..cargo import Cargo, CargoHold
from ..layout import Manifest
from ..partition import Partition
from .base import Arrival, Transport
from .collective import collective_for


class AllReduceTransport(Transport):
    """Buckets all-reduced among the workers as soon as they are complete, in a fixed
    order (every worker must issue collectives in the same order). The workers are the
    job's, or a subgroup's (`group`, a `comm.group.Group`: a pipeline stage's replicas).

    How a bucket moves (gloo / NCCL, or shared memory among the processes of one host)
    is the `collective` strategy, chosen once (transports/collective.py)."""

    weighs_itself = True  # no servers: each worker scales its own share b_i / Σb

    def __init__(self, ctx, group=None):
        super().__init__(ctx)
        self._group = group
        self._collective = None
        self.caps: BucketCaps = DDP_CAPS  # the engine's bucket tuner may change it (comm/buckets.py)
        self.hold = CargoHold()  # numbers to ride the next step's smallest bucket (`carry`)

    @property
    def members(self):
        """The group all-reduced over (the job's workers unless a subgroup was given)."""
        if self._group is None:
            from ..group import job_group

            self._group = job_group(self.ctx)
        return self._group

    @property
    def collective(self):
        """How buckets move (transports/collective.py), decided at the first use, once."""
        if self._collective is None:
            self._collective = collective_for(self.ctx, self.members)
        return self._collective

    @property
    def device_work(self) -> bool:
        """Whether a CUDA worker's buckets stay on its GPU (the engine's staging asks)."""
        return self.collective.device_work

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
        self.collective.begin(self.layout, staging)

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
        sent = view if self.hold.pending is None else self.hold.load(pid, view, self.staging)  # + a cargo's trailer
        return self.collective.start(pid, sent, view, self._what)

    def _launch(self) -> None:
        while self.next < len(self.order) and self.order[self.next] in self.ready:
            pid = self.order[self.next]
            view = self.staging.work_view(pid)
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
