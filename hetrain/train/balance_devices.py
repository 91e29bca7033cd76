"""What each worker of a balanced job reports at its start: its memory limit and its
device, exchanged so every worker knows every cap, and the check that each can hold its
smallest share (mixed into `balance.Balancer`, which sets the caps from them)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError
from ..perf.steptime import memory_caps as _memory_caps
from ..runtime.devices import worker_device
from ..runtime.memory import SOURCES, MemoryLimit, memory_limit
from .balance_config import BalanceConfig


class DeviceMemoryTooSmallError(UserError):
    """A worker's device cannot hold even the smallest share."""


def memory_caps(memory, cfg: BalanceConfig, limit: int) -> np.ndarray:
    """`hetrain.perf.steptime.memory_caps` with the per-sample and reserved bytes of `cfg`."""
    return _memory_caps(memory, cfg.memory_per_sample, cfg.reserved_bytes, limit)


@dataclass(frozen=True)
class WorkerDevice:
    """What each worker reported at start: its memory limit and device (for summaries)."""

    memory: float
    source: str
    cuda: bool
    index: int
    threads: int

    def label(self) -> str:
        return f"cuda:{self.index}" if self.cuda else f"cpu/{self.threads}t"


class DeviceReports:
    """The balancer's start: this worker's memory limit and device, and every worker's."""

    def _my_memory(self, override: list[float] | None) -> MemoryLimit:
        if override is not None:
            return MemoryLimit(float(override[self._rank()]), "cluster file", "given")
        topo = self.ctx.topology if self.ctx is not None else None
        if topo is not None:
            spec = topo.proc(self.ctx.rank).machine.device
            if spec is not None and spec.memory is not None:
                return MemoryLimit(float(spec.memory), "cluster file", "device.memory in the cluster file")
        if self.cfg.memory_per_sample <= 0:  # nothing to cap: skip the measurement
            return MemoryLimit(float("inf"), "unknown", "no per-sample memory given")
        lim = memory_limit(self.device)
        if topo is not None:
            # workers that share one memory split it evenly: CPU workers on one host share its
            # RAM (and cgroup); workers bound to one GPU of one host share its free memory
            me = topo.proc(self.ctx.rank)
            mine = worker_device(me)
            peers = [p for p in topo.workers if p.machine.node == me.machine.node
                     and p.machine.address == me.machine.address and worker_device(p) == mine]
            if len(peers) > 1:
                what = f"workers on this host's {mine}" if mine.type == "cuda" else "CPU workers on this host"
                return MemoryLimit(lim.bytes / len(peers), lim.source, f"{lim.detail}, split over {len(peers)} {what}")
        return lim

    def _rank(self) -> int:
        return self.ctx.rank if (self.ctx is not None and self.ctx.distributed) else 0

    def _exchange_devices(self, override) -> list[WorkerDevice]:
        lim = self._my_memory(override)
        row = np.array([lim.bytes, SOURCES.index(lim.source), float(self.device.type == "cuda"),
                        float(self.device.index or 0), float(torch.get_num_threads())])
        self.memory_detail = lim.detail
        rows = self._gather(row)()
        return [WorkerDevice(float(r[0]), SOURCES[int(r[1])], bool(r[2]), int(r[3]), int(r[4])) for r in rows]

    def _check_smallest_share(self, caps) -> None:
        if self.cfg.memory_per_sample <= 0 or self.cfg.min_samples == 0:
            return
        want = min(self.cfg.min_samples, max(1, self.global_batch // self.n))
        for lab, dev, cap in zip(self.labels, self.devices, caps):
            if cap >= want:
                continue
            need = self.cfg.reserved_bytes + want * self.cfg.memory_per_sample
            what = "GPU" if dev.cuda else "CPU"
            how = ("free memory on that GPU (other processes hold it: see nvidia-smi), " if dev.cuda else "")
            raise DeviceMemoryTooSmallError(
                f"worker {lab} ({dev.label()}): its {what} has {dev.memory / 2**20:.1f} MiB free ({dev.source}) but "
                f"its smallest share of {want} sample(s) needs {need / 2**20:.1f} MiB (model state "
                f"{self.cfg.reserved_bytes / 2**20:.1f} MiB + {self.cfg.memory_per_sample / 2**20:.3f} MiB per sample). "
                f"Make room: {how}use a smaller model, set min_samples=0 to let it sit out, or remove the worker "
                "from the cluster file (a `memory:` override there only changes what hetrain believes).")
