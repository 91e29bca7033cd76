"""`ServerTransport`: one worker per machine pushes every partition straight to its
summation server and pulls the sum back (gloo point-to-point), under the credit window."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..layout import Manifest
from ..partition import Partition, plan_for
from ..window import CreditWindow
from .base import Arrival, ServerLeg, Transport


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

