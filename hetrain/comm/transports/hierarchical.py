"""`HierarchicalTransport`: several workers on one machine reduce each partition to its
owner, the owner pushes it to the servers and pulls the sum, and the machine's workers
broadcast it from the owner (see the package docstring)."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch.distributed as dist

from .. import p2p
from ..layout import Manifest
from ..partition import Partition, plan_for
from ..window import CreditWindow
from .base import Arrival, ServerLeg, Transport
from .collective import local_shm


class HierarchicalTransport(Transport):
    """Several workers on one machine: local reduce -> owner push/pull -> local broadcast,
    per partition, pipelined (see the module docstring)."""

    machine_sum = True  # the machine's workers add b_l·g_l; the servers divide by Σb

    def __init__(self, ctx):
        super().__init__(ctx)
        self.shares = np.array([p.share for p in ctx.topology.servers])
        self.local = list(ctx.local_ranks)
        self.shm = local_shm(ctx)  # the in-host reduce and broadcast of host buffers, or None

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
        self.host = None  # shared memory for this step's local collectives (host buffers)
        if self.shm is not None and not staging.on_device:
            self.shm.begin(None, staging)
            # the work buffer in the machine's arena, else the host group's rounds; None where
            # /dev/shm had no room: gloo as before
            self.host = self.shm.arena or self.shm.host
        self.order = layout.order(self.backward_order())
        self.owner = {pid: self.local[layout.owner(pid, len(self.local))] for pid in range(len(layout.parts))}
        me = self.ctx.rank
        self.mine = {pid for pid, r in self.owner.items() if r == me}
        # no window: an owner posts every partition as soon as it is reduced, so no owner
        # ever waits for a sum while holding back a partition another one waits for
        self.leg = ServerLeg(self, CreditWindow(0, 1, unlimited=True), sort_reverse=self.backward_order())
        self.ready: set[int] = set()  # work buffer complete
        # what the staging and the server leg may have for a pass: asked only then, so a
        # pass with nothing new is one call (it runs at every tensor handed over)
        self.unready = 0  # partitions filled whose work buffer the staging has not confirmed
        self.staged = 0  # partitions staged out whose wire bytes out_ready has not returned
        # `Transport.polls`: local reduces in flight (their owner pushes when one completes),
        # or partitions the staging has yet to confirm or copy out
        self.polls = False
        self.next_reduce = 0
        self.reduces: deque = deque()  # (pid, work) in order
        self.summed: set[int] = set()  # the machine's sum (owner: the global sum) is in the work buffer
        self.next_bcast = 0
        self.bcasts: deque = deque()
        self.delivered = 0

    def filled(self, pids: list[int]) -> None:
        self.unready += len(pids)

    def _confirm(self, wait: bool) -> None:
        """The partitions whose work buffer the staging confirms complete (wait: at least one)."""
        got = self.staging.work_ready(wait)
        self.unready -= len(got)
        self.ready.update(got)

    def _push(self, wait: bool) -> None:
        """Post the staged partitions whose wire bytes are in host memory (wait: at least one)."""
        out = self.staging.out_ready(wait)
        self.staged -= len(out)
        self.leg.add(out)
        self.leg.flush(block=wait)

    def _collective(self, what: str, fn, view, **kw):
        if not self.staging.on_device:
            p2p.host_only(view, what)
        try:
            return fn(view, async_op=True, **kw)
        except RuntimeError as err:
            raise self.ctx.peer_error(what, [r for r in self.local if r != self.ctx.rank], err) from None

    def _step(self, block: bool = False) -> bool:
        """One pass over the pipeline; returns whether anything moved."""
        moved = False
        st = self.staging
        if self.unready:
            self._confirm(False)
        # 1. local reduces, in the fixed order, each to the partition's owner
        while self.next_reduce < len(self.order) and self.order[self.next_reduce] in self.ready:
            pid = self.order[self.next_reduce]
            self._touch()
            what = f"reducing partition {pid} among the machine's workers"
            w = (self._collective(what, dist.reduce, st.work_view(pid), dst=self.owner[pid], group=self.reduce_group)
                 if self.host is None else self.host.submit(self.host.reduce, st.work_view(pid), self.owner[pid], what))
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
                self.staged += 1
            else:
                self.summed.add(pid)
            moved = True
            block = False
        # 3. the owner's server leg
        if self.staged:
            n = self.staged
            self._push(False)
            moved = moved or self.staged < n
        # sums that came back wait for the broadcasts, which start once every reduce is
        # issued: before that, looked for only in a pass that moved something (a partition
        # filled or reduced), not at every tensor handed over
        if (moved or self.next_reduce == len(self.order)) and any(self.leg.inflight.values()):
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
            what = f"broadcasting partition {pid} from its owner"
            w = (self._collective(what, dist.broadcast, st.work_view(pid), src=self.owner[pid], group=self.bcast_group)
                 if self.host is None else self.host.submit(self.host.broadcast, st.work_view(pid), self.owner[pid],
                                                            what))
            self.bcasts.append((pid, w))
            self.next_bcast += 1
            moved = True
        # 5. broadcast done: the result goes to the user's tensors
        while self.bcasts and self.bcasts[0][1].is_completed():
            self._deliver(*self.bcasts.popleft())
            moved = True
        self.polls = bool(self.reduces or self.unready or self.staged)
        return moved

    def _deliver(self, pid: int, w) -> None:
        p2p.wait(w, self.ctx.peer_error, f"broadcasting partition {pid} from its owner", [self.owner[pid]])
        self.staging.deliver(pid)
        self.delivered += 1
        self.t_last = time.perf_counter()

    # polled at every tensor handed over while `polls`: one call, the pass itself, not a wrapper
    progress = _step

    def finish(self, idle: Callable[[], None] | None = None) -> None:
        total = len(self.layout.parts)
        while self.delivered < total:
            if self._step(block=False):
                continue
            # nothing moved: wait for the oldest thing in flight, in pipeline order (every
            # worker has issued everything it can, so whatever is oldest will complete)
            if self.next_reduce < len(self.order):
                self._confirm(True)
            elif self.reduces:
                self._step(block=True)
            elif self.staged:
                self._push(True)
            elif any(self.leg.inflight.values()):
                self.summed.add(self.leg.retire_oldest())
            elif self.bcasts:
                self._deliver(*self.bcasts.popleft())
            else:  # pragma: no cover - a pipeline that cannot move is a bug
                raise RuntimeError(f"hierarchical push_pull stalled at {self.delivered} of {total} partitions")

