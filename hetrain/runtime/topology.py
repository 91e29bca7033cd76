"""Which processes a job runs, and their ranks, for a cluster and a communication mode.

Ranks: workers 0..n-1 in cluster order (a machine with `gpus: N` contributes N workers
with local ranks 0..N-1, one per GPU), then summation servers: co-located ones (one per
worker machine, worker order) and then CPU-machine ones. Every node computes the same
table from the same cluster file, so no cluster manager is needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..cluster.spec import ClusterSpec, MachineSpec
from ..errors import UserError
from ..modes import Mode
from ..perf.comm import byteps_shares, optimal_split

MODES: tuple[str, ...] = tuple(m.value for m in Mode)  # the words `--mode` takes
_MIN_SHARE = 1e-9


@dataclass(frozen=True)
class Proc:
    rank: int
    role: Literal["worker", "server"]
    machine: MachineSpec
    index: int  # worker index, or server index
    share: float = 0.0  # servers: fraction of gradient bytes they sum
    local_rank: int = 0  # workers: index among the workers of its machine (its GPU)

    @property
    def label(self) -> str:
        return f"{self.machine.name}/{'w' if self.role == 'worker' else 's'}{self.index}"


@dataclass(frozen=True)
class Topology:
    mode: Mode
    procs: tuple[Proc, ...]

    @property
    def world_size(self) -> int:
        return len(self.procs)

    @property
    def workers(self) -> tuple[Proc, ...]:
        return tuple(p for p in self.procs if p.role == "worker")

    @property
    def servers(self) -> tuple[Proc, ...]:
        return tuple(p for p in self.procs if p.role == "server")

    @property
    def worker_ranks(self) -> list[int]:
        return [p.rank for p in self.workers]

    def proc(self, rank: int) -> Proc:
        return self.procs[rank]

    def describe(self, rank: int) -> str:
        p = self.procs[rank]
        local = f", local rank {p.local_rank}" if p.role == "worker" and p.machine.local_workers > 1 else ""
        return f"rank {rank} ({p.role} on machine {p.machine.name}{local})"

    @property
    def worker_machines(self) -> list[list[int]]:
        """The worker ranks of each worker machine, in cluster order."""
        out: dict[str, list[int]] = {}
        for p in self.workers:
            out.setdefault(p.machine.name, []).append(p.rank)
        return list(out.values())

    @property
    def worker_labels(self) -> list[str]:
        """One name per worker for logs and reports: the machine's, with `:<local rank>`
        on machines with several workers."""
        return [p.machine.name + (f":{p.local_rank}" if p.machine.local_workers > 1 else "") for p in self.workers]

    def local_peers(self, rank: int) -> list[int]:
        """The worker ranks on this worker's machine (itself included)."""
        name = self.procs[rank].machine.name
        return [p.rank for p in self.workers if p.machine.name == name]


def lanes_for(shares, max_lanes: int = 8) -> list[int]:
    """Parallel connections per server, proportional to its share (at least 1)."""
    shares = np.asarray(shares, dtype=float)
    smallest = shares[shares > 0].min()
    return [int(min(max_lanes, max(1, round(s / smallest)))) if s > 0 else 1 for s in shares]


def server_shares(cluster: ClusterSpec, mode: Mode | str) -> tuple[np.ndarray, np.ndarray]:
    """Fraction of gradient bytes for each co-located and each CPU server.

    byteps: the proven-optimal split (closed form for equal NICs, the LP of
    `perf.comm.optimal_split` for uneven ones); ps: CPU servers only; colocated: worker
    machines only (all-reduce-like traffic through servers).
    """
    mode = Mode.parse(mode)
    wbw = np.array([m.bandwidth for m in cluster.workers])
    cbw = np.array([m.bandwidth for m in cluster.cpu_machines])
    n, k = len(wbw), len(cbw)
    if not mode.has_servers:
        return np.zeros(n), np.zeros(k)
    if not mode.worker_servers:  # ps
        if k == 0:
            raise UserError(f"mode '{mode}' needs at least one cpu machine in the cluster; add one or use mode "
                            f"'{Mode.COLOCATED}'")
        return np.zeros(n), cbw / cbw.sum()
    if not mode.cpu_servers:  # colocated
        split = optimal_split(1.0, wbw, np.zeros(0))
        return split.gpu_bytes, np.zeros(k)
    return byteps_shares(wbw, cbw)  # the one rule, shared with the cost model (perf/comm.py)


def build_topology(cluster: ClusterSpec, mode: Mode | str = Mode.BYTEPS) -> Topology:
    mode = Mode.parse(mode)
    gpu_shares, cpu_shares = server_shares(cluster, mode)
    procs: list[Proc] = []
    for m in cluster.workers:
        for local in range(m.local_workers):
            procs.append(Proc(len(procs), "worker", m, len(procs), local_rank=local))
    servers = [(m, s) for m, s in zip(cluster.workers, gpu_shares) if s > _MIN_SHARE]
    servers += [(m, s) for m, s in zip(cluster.cpu_machines, cpu_shares) if s > _MIN_SHARE]
    total = sum(s for _, s in servers)
    for j, (m, s) in enumerate(servers):
        procs.append(Proc(len(procs), "server", m, j, s / total))
    return Topology(mode, tuple(procs))
