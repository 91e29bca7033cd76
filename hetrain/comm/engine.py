"""Worker side of push_pull: the one entry point for every communication mode.

`allreduce` uses torch.distributed's all-reduce among workers; the server modes
(`byteps`, `ps`, `colocated`) send partitions to summation servers in priority order
under a credit window (bytes in flight per worker) and receive the sums back. In every
mode the result is the batch-weighted average Σ b_i g_i / Σ b_i, so workers with
different batch sizes produce the update one machine would on the whole global batch.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import UserError
from ..runtime.context import Context, init
from .layout import Manifest, TensorMismatchError, exchange_manifests
from .protocol import check_header, exchange_header
from .server import plan_for


@dataclass
class CommStats:
    """Per-worker accounting for the step summary (seconds and bytes)."""

    steps: int = 0
    comm_s: float = 0.0  # moving partitions (or all-reduce)
    wait_s: float = 0.0  # waiting for the other workers (the step header)
    bytes_sent: int = 0
    bytes_received: int = 0
    per_step: list[dict] = field(default_factory=list)


class PushPull:
    def __init__(self, ctx: Context | None = None):
        self.ctx = ctx or init()
        self.stats = CommStats()
        self._digest = 0
        self._manifest: Manifest | None = None
        self._parts = []
        self._send = torch.empty(0)
        self._recv = torch.empty(0)
        self._server_ranks = [p.rank for p in self.ctx.topology.servers] if self.ctx.topology else []

    # ---- public -------------------------------------------------------------------------
    def push_pull(self, named: list[tuple[str, torch.Tensor]], weight: int = 1, average: bool = True) -> None:
        """Replace each tensor, in place, by the weighted average (or sum) over workers.

        `named` is in priority order: first = sent first (the input-side layers, needed
        first by the next forward pass). `weight` is this worker's batch size.
        """
        if weight < 0 or int(weight) != weight:
            raise UserError(f"push_pull weight must be a non-negative integer batch size, got {weight!r}")
        for name, t in named:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise UserError(f"push_pull tensor {name!r} must be a floating-point torch.Tensor, got {type(t).__name__}"
                                f"{'' if not isinstance(t, torch.Tensor) else ' of ' + str(t.dtype)}")
        ctx = self.ctx
        manifest = self._manifest_for(named)
        t0 = time.perf_counter()
        if not ctx.distributed:
            total = weight
        else:
            try:
                h = exchange_header(digest=manifest.digest(), weight=int(weight), numel=manifest.numel, is_worker=True)
            except RuntimeError as err:
                raise ctx.peer_error("exchanging the step header", [], err) from None
            try:
                check_header(h, ctx.num_workers, manifest)
            except TensorMismatchError:
                ctx.failed = True
                raise
            if h.digest != self._digest:
                exchange_manifests(manifest)
                self._digest = h.digest
                self._layout(manifest)
            total = h.weight
        if average and total == 0:
            raise UserError("every worker pushed with weight 0: at least one worker needs a non-empty batch")
        t1 = time.perf_counter()
        scale = (weight / total) if average else 1.0
        if not ctx.distributed:  # one process: the weighted average of one worker is itself
            self._account(t1 - t0, 0.0, 0)
            return
        self._fill(named, scale)
        if ctx.comm.mode == "allreduce":
            if ctx.bucket is not None:  # a ring moves 2(n-1)/n of the buffer through each uplink
                n = ctx.num_workers
                ctx.bucket.consume(int(2 * (n - 1) / n * self._send.numel() * 4))
            try:
                dist.all_reduce(self._send, group=ctx.worker_group)
            except RuntimeError as err:
                raise ctx.peer_error("all-reducing gradients", [], err) from None
            result = self._send
            moved = self._send.numel() * 4
        else:
            self._exchange_partitions()
            result = self._recv
            moved = self._send.numel() * 4
        self._unfill(named, result)
        self._account(t1 - t0, time.perf_counter() - t1, moved)

    def shutdown(self) -> None:
        """Tell the summation servers the job is over (every worker calls this once)."""
        if self.ctx.distributed and self._server_ranks and not self.ctx.failed:
            try:
                exchange_header(stop=True, is_worker=True)
            except RuntimeError as err:
                raise self.ctx.peer_error("telling the servers the job is over", [], err) from None

    # ---- internals ----------------------------------------------------------------------
    def _manifest_for(self, named) -> Manifest:
        m = Manifest.of(named)
        if self._manifest is None or m != self._manifest:
            self._manifest = m
        return self._manifest

    def _layout(self, manifest: Manifest) -> None:
        numel = manifest.numel
        self._send = torch.empty(numel, dtype=torch.float32)
        self._recv = torch.empty(numel, dtype=torch.float32)
        self._parts = plan_for(self.ctx, numel) if self._server_ranks else []
        credit = self.ctx.comm.credit_bytes or 2 * self.ctx.comm.partition_bytes * max(1, len(self._server_ranks))
        self._credit_elems = max(1, credit // 4)

    def _fill(self, named, scale: float) -> None:
        off = 0
        for _, t in named:
            n = t.numel()
            dst = self._send[off: off + n]
            dst.copy_(t.detach().reshape(-1))
            if scale != 1.0:
                dst.mul_(scale)
            off += n

    def _unfill(self, named, result: torch.Tensor) -> None:
        off = 0
        for _, t in named:
            n = t.numel()
            t.copy_(result[off: off + n].view_as(t))
            off += n

    def _exchange_partitions(self) -> None:
        """Priority-ordered partitions under a credit window of bytes in flight."""
        inflight: deque = deque()
        used = 0
        for p in self._parts:
            while inflight and used + p.length > self._credit_elems:
                used -= self._retire(inflight.popleft())
            dst = self._server_ranks[p.server]
            g = self.ctx.lane(p.lane)
            self.ctx.pace(dst, p.length * 4)
            s = dist.isend(self._send[p.start: p.start + p.length], dst=dst, tag=p.pid, group=g)
            r = dist.irecv(self._recv[p.start: p.start + p.length], src=dst, tag=p.pid, group=g)
            inflight.append((p, dst, s, r))
            used += p.length
        while inflight:
            self._retire(inflight.popleft())

    def _retire(self, item) -> int:
        p, dst, s, r = item
        try:
            s.wait()
            r.wait()
        except RuntimeError as err:
            raise self.ctx.peer_error(f"waiting for the sum of partition {p.pid}", [dst], err) from None
        return p.length

    def _account(self, wait_s: float, comm_s: float, moved: int) -> None:
        st = self.stats
        st.steps += 1
        st.wait_s += wait_s
        st.comm_s += comm_s
        st.bytes_sent += moved
        st.bytes_received += moved
        st.per_step.append({"wait_s": wait_s, "comm_s": comm_s, "bytes": moved})
