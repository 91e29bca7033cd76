"""The summation service: a server only adds gradient partitions and returns the sum.

The optimizer stays on the workers (BytePS's split of the parameter-server role), so a
server is optimizer-agnostic and cheap enough for spare CPU machines. Run it with
`python -m hetrain.comm.server` (the launcher does) on every server rank.

Each partition has one pusher per worker machine (comm/flatlayout.py): the machine's
only worker, or, on a machine with several workers, the one that owns the partition
after the machine's local reduce. The server weights each machine's push by the factor
the announcement gives (comm/protocol.py, `ControlInbox.coefficients`), so the sum is
the batch-weighted average over every worker whatever the machines look like.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch

from ..runtime.context import Context, init, teardown
from . import p2p
from .compress import ErrorFeedback
from .flatlayout import FlatLayout
from .known import KnownLayouts
from .layout import Entry, Manifest, exchange_manifests
from .partition import Partition, plan_for
from .protocol import OK, SLOW, STOPPED, ControlInbox, check_header, exchange_header, part_tag, speculating
from .shm.select import channels_for
from .wire import decode_part, encode_part, wire_codecs


class SummationServer:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        me = ctx.topology.proc(ctx.rank)
        self.index = me.index
        self.workers = ctx.topology.worker_ranks
        self.machines = ctx.topology.worker_machines  # worker ranks (= indices) per machine
        self.machine_names = [ctx.topology.proc(m[0]).machine.name for m in self.machines]
        self.n_servers = len(ctx.topology.servers)
        self.shares = np.array([p.share for p in ctx.topology.servers])
        self.digest = 0
        self.epoch = 0  # the layout's block of partition tags (comm/known.py)
        self.known: KnownLayouts[tuple] = KnownLayouts()  # as every worker's Announcer keeps them
        self.coef = torch.ones(len(self.machines))
        self.conflict = -1
        self.mine: list[Partition] = []
        self.pushers: list[tuple[int, ...]] = []
        self.bufs: list[torch.Tensor] = []
        self.sums: list[torch.Tensor] = []
        self.wire = None
        self.steps = 0
        self.busy_s = 0.0
        # per worker: shared memory where it runs on this host, else gloo (comm/shm/select.py)
        self.channels = channels_for(ctx, self.workers)

    def _replan(self, numel: int, manifest: Manifest | None = None) -> None:
        c = self.ctx.comm
        parts = plan_for(self.shares, numel, c.partition_bytes, c.max_lanes)
        codecs = wire_codecs(manifest, c, self.ctx.cluster) if manifest is not None and manifest.numel == numel else None
        if manifest is None or manifest.numel != numel:
            manifest = Manifest((Entry("flat", (numel,)),))  # only the size is known
        layout = FlatLayout.build(manifest, parts, codecs, self.machines)
        self.mine = [p for p in parts if p.server == self.index]
        self.pushers = [layout.pushers[p.pid] for p in self.mine]
        n = len(self.machines)
        self.wire = [layout.wire[p.pid] for p in self.mine] if layout.wire is not None else None
        if self.wire is None:
            self.bufs = [torch.empty(n, p.length) for p in self.mine]
            self.sums = [torch.empty(p.length) for p in self.mine]
        else:
            # encoded pushes in, decoded to fp32, summed, re-encoded (with the server's own
            # error feedback, so the downlink loses no mass either) and sent back
            self.bufs = [torch.empty(n, w.nbytes, dtype=torch.uint8) for w in self.wire]
            self.sums = [torch.empty(w.nbytes, dtype=torch.uint8) for w in self.wire]
            self.decoded = [torch.empty(n, p.length) for p in self.mine]
            self.total = torch.zeros(numel)
            self.feedback = ErrorFeedback(numel)

    def serve_forever(self) -> None:
        inbox = ControlInbox(self.workers)
        spec = None  # receives already posted for the next step (same layout)
        while True:
            rows = inbox.wait(lambda w, err: self.ctx.peer_error("waiting for the next step", [w], err))
            self.coef, self.conflict = inbox.coefficients(rows, self.machines)
            status = inbox.verdict(rows, self.digest, self.conflict)
            if status == STOPPED:  # receives still posted for a next step are dropped at teardown
                self._wait_all(inbox.answer(STOPPED, 0), "telling it the servers stopped")
                return
            inbox.repost()
            if status == OK:
                recvs = spec if spec is not None else self._post_recvs()
                answers = inbox.answer(OK, int(rows[:, 3].sum()))
                spec = self._round(recvs)
                self._wait_all(answers, "answering its step announcement")
            else:
                self._wait_all(inbox.answer(SLOW, 0), "answering its step announcement")
                done, spec = self._slow_step(spec)
                if not done:
                    return
            self.steps += 1

    def _slow_step(self, spec: list | None) -> tuple[bool, list | None]:
        """The full header path (first step, another layout, mismatch, partial stop).
        `spec`: the receives posted for the next step of the current layout, kept with it
        when another layout comes (comm/known.py) and used when it comes back. Returns
        whether the job goes on, and the next step's receives."""
        conflict = self.conflict + 1 if self.conflict >= 0 else 0
        try:
            h = exchange_header(is_worker=False, conflict=conflict, group=self.ctx.host_group)
        except RuntimeError as err:
            raise self.ctx.peer_error("waiting for the next step", [], err) from None
        if h.stops == len(self.workers):  # pragma: no cover - the control messages catch a full stop
            return False, None
        try:
            check_header(h, len(self.workers), None, self.n_servers, self.machine_names, host_group=self.ctx.host_group)
        except Exception:
            self.ctx.failed = True
            raise
        if h.digest != self.digest:
            spec = self._switch(h, spec)
        return True, self._round(spec if spec is not None else self._post_recvs())

    _KEPT = ("mine", "pushers", "wire", "bufs", "sums", "decoded", "total", "feedback")

    def _switch(self, h, spec: list | None) -> list | None:
        """Another layout was agreed: keep the current one's buffers, codec residuals and
        posted receives, and take the new one's back if it was kept; else learn it (the
        workers publish a new layout: servers need its size and, for codecs, its tensors).
        Returns the receives already posted for its step, if any."""
        epoch, known = self.known.switch(h.digest)
        self.known.stash(self.digest, ({k: getattr(self, k, None) for k in self._KEPT}, spec))
        kept = self.known.take(h.digest)
        self.digest, self.epoch = h.digest, epoch
        if known:  # every worker skips the manifests too
            if kept is None:  # pragma: no cover - a known layout was left, so kept
                raise RuntimeError(f"summation server: layout {h.digest} is known but was not kept")
            state, spec = kept
            for k, v in state.items():
                setattr(self, k, v)
            return spec
        manifests = [m for m in exchange_manifests(None, self.ctx.host_group) if m is not None]
        self._replan(h.numel_each, manifests[0] if manifests else None)
        return None

    def _wait_all(self, works, what: str) -> None:
        p2p.wait_all(works, self.ctx.peer_error, what)

    def _post_recvs(self) -> list:
        return [self._post_recv(i) for i in range(len(self.mine))]

    def _post_recv(self, i: int) -> list:
        p, buf = self.mine[i], self.bufs[i]
        g, tag = self.ctx.lane(p.lane), part_tag(self.epoch, p.pid)
        what = f"receiving partition {p.pid}"
        return [self.channels[w].irecv(buf[k], tag, g, what) for k, w in enumerate(self.pushers[i])]

    def _round(self, recvs: list) -> list | None:
        """Sum every partition and send it back. While speculating, each partition's
        receives for the next step are posted as soon as its buffer is free, spread over
        the round (posting them all at its end delayed the next step's first sums)."""
        spec = speculating(self.epoch)
        nxt: list = [None] * len(self.mine)
        sends = []
        order = list(range(len(self.mine)))
        if self.ctx.comm.overlap and not self.ctx.comm.credit_bytes:
            # with --overlap workers post every partition without waiting, in the order
            # backward produces them (last layers first), also outside DistributedOptimizer
            order.reverse()
        for i in order:
            sends.extend(self._sum_one(i, recvs[i]))
            if spec:
                nxt[i] = self._post_recv(i)
        for w, pid, work in sends:
            p2p.wait(work, self.ctx.peer_error, f"returning the sum of partition {pid} to it", [w])
        return nxt if spec else None

    def _sum_one(self, i: int, works) -> list:
        p, buf, total = self.mine[i], self.bufs[i], self.sums[i]
        pushers = self.pushers[i]
        for w, work in zip(pushers, works):
            p2p.wait(work, self.ctx.peer_error, f"receiving partition {p.pid} from it", [w])
        t0 = time.perf_counter()
        if self.wire is None:
            torch.matmul(self.coef[None], buf, out=total[None])  # Σ_m c_m·push_m: one vectorised pass
        else:
            self._sum_encoded(i, buf, total)
        self.busy_s += time.perf_counter() - t0
        g = self.ctx.lane(p.lane)
        for w in pushers:
            self.ctx.pace(w, total.numel() * total.element_size())
        tag = part_tag(self.epoch, p.pid)
        what = f"returning the sum of partition {p.pid}"
        return [(w, p.pid, self.channels[w].isend(total, tag, g, what)) for w in pushers]

    def _sum_encoded(self, i: int, buf: torch.Tensor, out: torch.Tensor) -> None:
        w, dec = self.wire[i], self.decoded[i]
        p = w.part
        for row in range(buf.shape[0]):
            decode_part(w, buf[row], dec[row], base=p.start)
        flat = self.total
        torch.matmul(self.coef[None], dec, out=flat[p.start: p.start + p.length][None])
        encode_part(w, flat, out, self.feedback)


def main() -> int:
    ctx = init()
    if not ctx.comm.synchronous:  # async / bounded staleness: servers hold and update the parameters
        from .async_ps import ParameterServer

        ps = ParameterServer(ctx)
        try:
            ps.serve_forever()
        finally:
            teardown(ctx)
        ps.write_report(ctx.env.run_dir)
        print(f"{ctx.describe(ctx.rank)}: applied {ps.pushes} pushes ({ctx.comm.sync}); largest clock gap "
              f"{ps.max_gap}", flush=True)
        return 0
    server = SummationServer(ctx)
    try:
        server.serve_forever()
    finally:
        teardown(ctx)
    print(f"{ctx.describe(ctx.rank)}: served {server.steps} steps, summing took {server.busy_s:.3f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
