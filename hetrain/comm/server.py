"""The summation service: a server only adds gradient partitions and returns the sum.

The optimizer stays on the workers (BytePS's split of the parameter-server role), so a
server is optimizer-agnostic and cheap enough for spare CPU machines. Run it with
`python -m hetrain.comm.server` (the launcher does) on every server rank.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from ..runtime.context import Context, init, teardown
from .compress import ErrorFeedback
from .layout import Manifest, exchange_manifests
from .partition import Partition, lanes_for, plan_partitions, split_lanes
from .protocol import OK, SLOW, STOPPED, ControlInbox, check_header, exchange_header, part_tag, speculating
from .wire import decode_part, encode_part, tensor_codecs, wire_plan


def plan_for(ctx: Context, numel: int) -> list[Partition]:
    """The partition plan every rank derives from the same manifest size and shares."""
    shares = np.array([p.share for p in ctx.topology.servers])
    elems = max(1, ctx.comm.partition_bytes // 4)
    return split_lanes(plan_partitions(numel, shares, elems), lanes_for(shares, ctx.comm.max_lanes))


class SummationServer:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        me = ctx.topology.proc(ctx.rank)
        self.index = me.index
        self.workers = ctx.topology.worker_ranks
        self.digest = 0
        self.epoch = 0  # layouts seen so far (partition tags carry it)
        self.coef = torch.ones(len(self.workers))
        self.mine: list[Partition] = []
        self.bufs: list[torch.Tensor] = []
        self.sums: list[torch.Tensor] = []
        self.steps = 0
        self.busy_s = 0.0

    def _replan(self, numel: int, manifest: Manifest | None = None) -> None:
        parts = plan_for(self.ctx, numel)
        self.mine = [p for p in parts if p.server == self.index]
        n = len(self.workers)
        self.wire = None
        if manifest is not None and manifest.numel == numel:
            from .engine import wire_codecs

            wire = wire_plan(parts, manifest, wire_codecs(self.ctx, manifest))
            if wire is not None:
                self.wire = [wire[p.pid] for p in self.mine]
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
            status = inbox.verdict(rows, self.digest)
            if status == STOPPED:  # receives still posted for a next step are dropped at teardown
                self._wait_all(inbox.answer(STOPPED, 0), "telling it the servers stopped")
                return
            inbox.repost()
            self.coef = inbox.coefficients(rows)
            if status == OK:
                recvs = spec if spec is not None else self._post_recvs()
                answers = inbox.answer(OK, int(rows[:, 3].sum()))
                spec = self._round(recvs)
                self._wait_all(answers, "answering its step announcement")
            else:
                self._wait_all(inbox.answer(SLOW, 0), "answering its step announcement")
                done, spec = self._slow_step()
                if not done:
                    return
            self.steps += 1

    def _slow_step(self) -> tuple[bool, list | None]:
        """The full header path (first step, new layout, mismatch, partial stop).
        Returns whether the job goes on, and the next step's receives."""
        try:
            h = exchange_header(is_worker=False)
        except RuntimeError as err:
            raise self.ctx.peer_error("waiting for the next step", [], err) from None
        if h.stops == len(self.workers):  # pragma: no cover - the control messages catch a full stop
            return False, None
        try:
            check_header(h, len(self.workers), None)
        except Exception:
            self.ctx.failed = True
            raise
        if h.digest != self.digest:
            # workers publish the new layout; servers need its size and (for codecs) its tensors
            manifests = [m for m in exchange_manifests(None) if m is not None]
            self.digest = h.digest
            self.epoch += 1
            self._replan(h.numel_each, manifests[0] if manifests else None)
        return True, self._round(self._post_recvs())

    def _wait_all(self, works, what: str) -> None:
        for w, work in works:
            self._wait(work, w, what)

    def _post_recvs(self) -> list:
        return [self._post_recv(i) for i in range(len(self.mine))]

    def _post_recv(self, i: int) -> list:
        p, buf = self.mine[i], self.bufs[i]
        g, tag = self.ctx.lane(p.lane), part_tag(self.epoch, p.pid)
        return [dist.irecv(buf[k], src=w, tag=tag, group=g) for k, w in enumerate(self.workers)]

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
            self._wait(work, w, f"returning the sum of partition {pid} to it")
        return nxt if spec else None

    def _sum_one(self, i: int, works) -> list:
        p, buf, total = self.mine[i], self.bufs[i], self.sums[i]
        for w, work in zip(self.workers, works):
            self._wait(work, w, f"receiving partition {p.pid} from it")
        t0 = time.perf_counter()
        if self.wire is None:
            torch.matmul(self.coef, buf, out=total)  # Σ_i c_i·push_i, c_i = b_i/Σb: one vectorised pass
        else:
            self._sum_encoded(i, buf, total)
        self.busy_s += time.perf_counter() - t0
        g = self.ctx.lane(p.lane)
        for w in self.workers:
            self.ctx.pace(w, total.numel() * total.element_size())
        tag = part_tag(self.epoch, p.pid)
        return [(w, p.pid, dist.isend(total, dst=w, tag=tag, group=g)) for w in self.workers]

    def _sum_encoded(self, i: int, buf: torch.Tensor, out: torch.Tensor) -> None:
        w, dec = self.wire[i], self.decoded[i]
        p = w.part
        for row in range(buf.shape[0]):
            decode_part(w, buf[row], dec[row], base=p.start)
        flat = self.total
        torch.matmul(self.coef, dec, out=flat[p.start: p.start + p.length])
        encode_part(w, flat, out, self.feedback)

    def _wait(self, work, peer: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise self.ctx.peer_error(what, [peer], err) from None


def main() -> int:
    ctx = init()
    if ctx.comm.sync != "sync":  # async / bounded staleness: servers hold and update the parameters
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
