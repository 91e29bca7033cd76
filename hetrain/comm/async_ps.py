"""Asynchronous and bounded-staleness training: parameter servers that hold parameters.

In these modes the summation servers become classic parameter servers. Each server
holds its partitions of the flat parameter vector (the same single partitioner as the
synchronous modes) and applies SGD (with momentum) to every gradient as it arrives.
A worker pushes its gradient, then pulls the latest parameters, without waiting for
the other workers.

Bounded staleness (SSP, staleness bound s): every worker's clock counts its pushes; a
server holds back a worker's pull while that worker is more than s clocks ahead of the
slowest running worker, so the fastest worker never gets more than s steps ahead
(s = 0 is lock-step). Asynchronous mode is the same with no bound.

Each push is scaled by the pushing worker's share of the batch, b_i / Σ_j b_j (the
latest batch size of every worker), so a round of pushes, one per worker, moves the
parameters as one synchronous step on the global batch would, and the same learning
rate works in every mode.

Wire format: a float64 control tensor [kind, worker, clock, lr, momentum, numel, batch] with
a fixed tag, then a float32 slice; servers listen to any worker for control tensors.
Replies carry the parameters plus [server version, slowest clock]. Nothing is pickled.
Tags come from the async-ps range of comm/p2p.py. A GPU worker's gradients and
parameters cross to the host through one pinned buffer per direction.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..runtime.context import Context
from . import p2p
from .partition import Partition, plan_for

CTRL_TAG, DATA_TAG, PARAM_TAG = p2p.ASYNC_PS(0), p2p.ASYNC_PS(1), p2p.ASYNC_PS(2)
SETUP, PUSH, STOP = 1.0, 2.0, 3.0
CTRL_LEN = 7


def bound_of(ctx: Context) -> float:
    """The staleness bound s of the job (inf for fully asynchronous)."""
    return ctx.comm.bound


def parts_of(ctx: Context, numel: int) -> list[Partition]:
    """The same partition plan as the synchronous modes (comm/partition.py)."""
    shares = np.array([p.share for p in ctx.topology.servers])
    return plan_for(shares, numel, ctx.comm.partition_bytes, ctx.comm.max_lanes)


def server_index(parts: list[Partition], j: int) -> torch.Tensor:
    """Flat-buffer elements that server j holds, in partition order."""
    mine = [torch.arange(p.start, p.start + p.length) for p in parts if p.server == j]
    return torch.cat(mine) if mine else torch.zeros(0, dtype=torch.int64)


class AsyncClient:
    """Worker side: push a gradient, pull fresh parameters (optimizer runs on servers)."""

    def __init__(self, ctx: Context, named_params: list[tuple[str, torch.Tensor]], lr: float, momentum: float = 0.0,
                 batch: int = 1):
        if not ctx.topology or not ctx.topology.servers:
            raise UserError(f"sync mode {ctx.comm.sync!r} needs parameter servers; use mode ps, byteps or colocated")
        self.ctx = ctx
        self.params = [p for _, p in named_params]
        self.numel = sum(p.numel() for p in self.params)
        self.servers = [p.rank for p in ctx.topology.servers]
        parts = parts_of(ctx, self.numel)
        self.index = [server_index(parts, j) for j in range(len(self.servers))]
        self.worker = ctx.topology.proc(ctx.rank).index
        self.lr, self.momentum = float(lr), float(momentum)
        self.clock = 0
        self.batch = max(0, int(batch))  # announced with SETUP: the first round is weighted right
        self.bound = bound_of(ctx)
        self.max_gap = 0  # largest (my clock − slowest clock) seen when a pull returned
        self.wait_s = 0.0  # time blocked on pulls (includes being held back by the bound)
        self.bytes = 0
        self._replies = [torch.zeros(len(ix) + 2) for ix in self.index]
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise UserError(f"DistributedOptimizer: parameters are on several devices ({sorted(map(str, devices))}); "
                            "put the whole model on hetrain.device()")
        self.device = devices.pop() if devices else torch.device("cpu")
        pinned = self.device.type == "cuda"  # gradients and parameters cross PCIe once per step each
        self._host = torch.empty(self.numel, pin_memory=pinned)
        self._exchange(SETUP, self._to_host([p.detach() for p in self.params]))

    def _to_host(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors back to back as fp32 in host memory (never a device pointer for gloo)."""
        flat = p2p.flatten(tensors, dtype=torch.float32) if self.device.type == "cuda" else None
        if flat is not None:
            self._host.copy_(flat)
            return self._host
        return p2p.flatten(tensors, dtype=torch.float32, out=self._host)

    def _exchange(self, kind: float, flat: torch.Tensor | None) -> None:
        """Send a control tensor (and a slice) to every server; unless stopping, pull
        the parameters back. Receives are posted first and sends are non-blocking, so
        no cycle of blocked sends can form between workers and servers."""
        pull = kind != STOP
        recvs = [p2p.irecv(buf, src, PARAM_TAG) for buf, src in zip(self._replies, self.servers)] if pull else []
        ctrl = torch.tensor([kind, self.worker, self.clock, self.lr, self.momentum, self.numel, self.batch],
                            dtype=torch.float64)
        sends = []
        for j, dst in enumerate(self.servers):
            sends.append((dst, p2p.isend(ctrl, dst, CTRL_TAG), ctrl))
            if flat is not None:
                payload = flat[self.index[j]].contiguous()
                sends.append((dst, p2p.isend(payload, dst, DATA_TAG), payload))
                self.bytes += payload.numel() * 4
        t0 = time.perf_counter()
        p2p.wait_all([(dst, w) for dst, w, _ in sends], self.ctx.peer_error, "pushing to it")
        p2p.wait_all(list(zip(self.servers, recvs)), self.ctx.peer_error, "pulling parameters from it")
        self.wait_s += time.perf_counter() - t0
        if pull:
            self._apply()

    def _apply(self) -> None:
        flat = self._host
        for ix, buf in zip(self.index, self._replies):
            flat[ix] = buf[:-2]
            self.bytes += buf.numel() * 4
            self.max_gap = max(self.max_gap, int(self.clock - buf[-1].item()))
        src = flat.to(self.device, non_blocking=True) if self.device.type == "cuda" else flat
        p2p.copy_back(src, self.params)

    def step(self, lr: float | None = None, batch_size: int | None = None) -> None:
        """Push this worker's gradients (p.grad, the mean over its `batch_size` samples)
        and replace the parameters by the latest."""
        if lr is not None:
            self.lr = float(lr)
        if batch_size is not None:
            self.batch = max(0, int(batch_size))
        grads = self._to_host([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        self.clock += 1
        self._exchange(PUSH, grads)

    def shutdown(self) -> None:
        if not self.ctx.failed:
            self._exchange(STOP, None)


def send_stop(ctx: Context) -> None:
    """Tell every parameter server this worker is done (also when it never pushed)."""
    ctrl = torch.tensor([STOP, ctx.topology.proc(ctx.rank).index, 0, 0, 0, 0, 0], dtype=torch.float64)
    for s in ctx.topology.servers:
        try:
            p2p.send(ctrl, s.rank, CTRL_TAG)
        except RuntimeError as err:
            raise ctx.peer_error("telling the parameter servers the job is over", [s.rank], err) from None


class ParameterServer:
    """Server side: hold parameters, apply each push, release pulls within the bound."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.index = ctx.topology.proc(ctx.rank).index
        self.workers = ctx.topology.worker_ranks
        self.bound = bound_of(ctx)
        self.params: torch.Tensor | None = None
        self.velocity: torch.Tensor | None = None
        self.version = 0
        self.clocks = {w: 0 for w in self.workers}
        self.batches: dict[int, float | None] = {w: None for w in self.workers}  # latest batch size per worker
        self.stopped: set[int] = set()
        self.joined: set[int] = set()  # workers whose SETUP arrived
        self.waiting: list[int] = []  # workers whose pull is held back
        self.max_gap = 0
        self.pushes = 0
        self.sends: list = []

    def _slowest(self) -> float:
        running = [c for w, c in self.clocks.items() if w not in self.stopped]
        return min(running) if running else max(self.clocks.values())

    def _release(self) -> None:
        slowest = self._slowest()
        # the first pull (after SETUP) waits for every worker's SETUP: then every worker's
        # batch size is known before the first push is weighted, and all start alike
        everyone = len(self.joined | self.stopped) == len(self.workers)
        still = []
        for w in self.waiting:
            gap = self.clocks[w] - slowest
            if gap <= self.bound and (everyone or self.clocks[w] > 0):
                self.max_gap = max(self.max_gap, int(gap))
                reply = torch.cat([self.params, torch.tensor([float(self.version), float(slowest)])])
                self.sends.append((w, p2p.isend(reply, w, PARAM_TAG), reply))
            else:
                still.append(w)
        self.waiting = still
        keep = []
        for w, work, buf in self.sends:  # retire finished replies without blocking
            if work.is_completed():
                p2p.wait(work, self.ctx.peer_error, "returning parameters to it", [w])
            else:
                keep.append((w, work, buf))
        self.sends = keep

    def serve_forever(self) -> None:
        ctrl = torch.zeros(CTRL_LEN, dtype=torch.float64)
        index = None
        while len(self.stopped) < len(self.workers):
            try:
                src = p2p.recv(ctrl, None, CTRL_TAG)
            except RuntimeError as err:
                raise self.ctx.peer_error("waiting for a push", [], err) from None
            kind, _, clock, lr, momentum, numel, batch = ctrl.tolist()
            if kind == STOP:
                self.stopped.add(src)
            else:
                if index is None:
                    index = server_index(parts_of(self.ctx, int(numel)), self.index)
                data = torch.empty(len(index))
                try:
                    p2p.recv(data, src, DATA_TAG)
                except RuntimeError as err:
                    raise self.ctx.peer_error("receiving a push", [src], err) from None
                if kind == SETUP:
                    if self.params is None:  # every worker starts from the same parameters
                        self.params = data.clone()
                        self.velocity = torch.zeros_like(data)
                    self.joined.add(src)
                    self.batches[src] = batch
                else:
                    self.batches[src] = batch
                    known = [b for b in self.batches.values() if b is not None]
                    total = sum(known) + batch * (len(self.workers) - len(known))
                    if total > 0:
                        data.mul_(batch / total)
                    else:
                        data.zero_()
                    if momentum:
                        self.velocity.mul_(momentum).add_(data)
                        self.params.add_(self.velocity, alpha=-lr)
                    else:
                        self.params.add_(data, alpha=-lr)
                    self.version += 1
                    self.pushes += 1
                self.clocks[src] = int(clock)
                self.waiting.append(src)
            self._release()
        p2p.wait_all([(w, work) for w, work, _ in self.sends], self.ctx.peer_error, "returning parameters to it")

    def write_report(self, run_dir: str) -> None:
        path = Path(run_dir) / f"ps-server{self.index}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"bound": None if math.isinf(self.bound) else self.bound,
                                    "max_gap": self.max_gap, "pushes": self.pushes, "version": self.version}))
