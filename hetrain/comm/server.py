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

from ..runtime.context import Context, init
from .layout import Manifest, exchange_manifests
from .partition import Partition, lanes_for, plan_partitions, split_lanes
from .protocol import check_header, exchange_header


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
        self.mine: list[Partition] = []
        self.bufs: list[torch.Tensor] = []
        self.sums: list[torch.Tensor] = []
        self.steps = 0
        self.busy_s = 0.0

    def _replan(self, numel: int) -> None:
        parts = plan_for(self.ctx, numel)
        self.mine = [p for p in parts if p.server == self.index]
        n = len(self.workers)
        self.bufs = [torch.empty(n, p.length) for p in self.mine]
        self.sums = [torch.empty(p.length) for p in self.mine]

    def serve_forever(self) -> None:
        while True:
            try:
                h = exchange_header(is_worker=False)
            except RuntimeError as err:
                raise self.ctx.peer_error("waiting for the next step", [], err) from None
            if h.stops == len(self.workers):
                return
            try:
                check_header(h, len(self.workers), None)
            except Exception:
                self.ctx.failed = True
                raise
            if h.digest != self.digest:
                exchange_manifests(None)  # workers publish the new layout; servers need only its size
                self.digest = h.digest
                self._replan(h.numel_each)
            self._round()
            self.steps += 1

    def _round(self) -> None:
        recvs = []
        for p, buf in zip(self.mine, self.bufs):
            g = self.ctx.lane(p.lane)
            recvs.append([dist.irecv(buf[i], src=w, tag=p.pid, group=g) for i, w in enumerate(self.workers)])
        sends = []
        for p, buf, total, works in zip(self.mine, self.bufs, self.sums, recvs):
            for w, work in zip(self.workers, works):
                self._wait(work, w, f"receiving partition {p.pid} from it")
            t0 = time.perf_counter()
            torch.sum(buf, dim=0, out=total)  # vectorised add of n pushes
            self.busy_s += time.perf_counter() - t0
            g = self.ctx.lane(p.lane)
            for w in self.workers:
                self.ctx.pace(w, p.length * 4)
            sends.extend((w, p.pid, dist.isend(total, dst=w, tag=p.pid, group=g)) for w in self.workers)
        for w, pid, work in sends:
            self._wait(work, w, f"returning the sum of partition {pid} to it")

    def _wait(self, work, peer: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise self.ctx.peer_error(what, [peer], err) from None


def main() -> int:
    ctx = init()
    server = SummationServer(ctx)
    try:
        server.serve_forever()
    finally:
        if dist.is_initialized() and not ctx.failed:
            dist.destroy_process_group()
    print(f"{ctx.describe(ctx.rank)}: served {server.steps} steps, summing took {server.busy_s:.3f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
