"""Which device each worker computes on, and which collective backend its groups use.

A worker of a machine with `device.cuda: true` is bound to `cuda:<local rank>` (one
process per GPU, `gpus: N`); every other worker computes on the CPU (an emulated device).
Every rank derives the same `Backends` from the cluster file and the job flags alone (not
from what its own node has), because every rank must create the same process groups in
the same order. Whether this node can honour them is checked separately: by the launcher
before any process starts (`preflight`) and by each worker when it binds its GPU.

NCCL is used where it fits: for the worker group when every worker is a CUDA GPU of its
own, and for the local group of a machine with several CUDA GPUs. NCCL refuses two ranks
of one communicator on one GPU, so workers that share a GPU (several emulated machines on
one node with `cuda: true`) stay on gloo, which the engine feeds from pinned host buffers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..cluster.spec import ClusterSpec
from ..errors import UserError
from .env import CommConfig
from .topology import Proc, Topology

Backend = Literal["gloo", "nccl"]


def worker_device(proc: Proc) -> torch.device:
    """The device this process's tensors belong on (cpu for servers and emulated devices)."""
    dev = proc.machine.device
    if proc.role == "worker" and dev is not None and dev.cuda:
        return torch.device("cuda", proc.local_rank)
    return torch.device("cpu")


def is_cuda(proc: Proc) -> bool:
    return worker_device(proc).type == "cuda"


def shared_gpus(topo: Topology) -> dict[tuple[int, int], list[Proc]]:
    """CUDA workers that would land on the same physical GPU: same node, same local rank."""
    by_gpu: dict[tuple[int, int], list[Proc]] = {}
    for p in topo.workers:
        if is_cuda(p):
            by_gpu.setdefault((p.machine.node, p.local_rank), []).append(p)
    return {k: v for k, v in by_gpu.items() if len(v) > 1}


@dataclass(frozen=True)
class Backends:
    """The backend of the worker group's collectives on CUDA tensors, and of each
    multi-worker machine's local groups (by machine name)."""

    worker: Backend = "gloo"
    local: dict[str, Backend] = field(default_factory=dict)

    @property
    def uses_nccl(self) -> bool:
        return self.worker == "nccl" or "nccl" in self.local.values()


def plan_backends(topo: Topology, comm: CommConfig) -> Backends:
    """Decide once per job, identically on every rank. Raises UserError when the flags ask
    for NCCL where it cannot work."""
    workers = topo.workers
    shared = shared_gpus(topo)
    if comm.collective == "nccl":
        emulated = sorted({p.machine.name for p in workers if not is_cuda(p)})
        if emulated:
            raise UserError(f"--collective nccl needs every worker on a CUDA GPU, but machine(s) {', '.join(emulated)} "
                            "have emulated devices; set `device.cuda: true` for them or use --collective gloo")
        if shared:
            (node, gpu), procs = next(iter(shared.items()))
            names = ", ".join(sorted({p.machine.name for p in procs}))
            raise UserError(f"--collective nccl: machines {names} all put a worker on GPU {gpu} of node {node}, and NCCL "
                            "refuses two ranks on one GPU; give each machine its own node or GPUs, or use "
                            "--collective gloo (the staged path lets workers share a GPU)")
    nccl_ok = comm.collective != "gloo"
    worker = group_backend(topo, topo.worker_ranks, comm)
    local: dict[str, Backend] = {}
    for ranks in topo.worker_machines:
        m = topo.proc(ranks[0]).machine
        if len(ranks) > 1:
            # a machine's own GPUs are distinct devices; its local group never shares one
            local[m.name] = "nccl" if nccl_ok and m.device is not None and m.device.cuda else "gloo"
    return Backends(worker, local)


def group_backend(topo: Topology, ranks, comm: CommConfig) -> Backend:
    """The backend of a group of workers' collectives on CUDA tensors (the job's workers,
    or a subgroup such as a pipeline stage's replicas): NCCL when the group has several
    members, every one a CUDA GPU of its own (distinct node and local rank: NCCL refuses
    two ranks of one communicator on one GPU), unless --collective gloo; gloo otherwise,
    fed from pinned host buffers. Pure: every rank derives the same answer."""
    procs = [topo.proc(r) for r in ranks]
    if comm.collective == "gloo" or len(procs) < 2 or not all(is_cuda(p) for p in procs):
        return "gloo"
    gpus = {(p.machine.node, p.local_rank) for p in procs}
    return "nccl" if len(gpus) == len(procs) else "gloo"


def preflight(cluster: ClusterSpec, topo: Topology, comm: CommConfig, node_rank: int | None) -> Backends:
    """Before any process starts: does this node have the GPUs (and NCCL) its machines
    ask for? `node_rank` None checks every machine (an embedded cluster on this host)."""
    backends = plan_backends(topo, comm)
    mine = [m for m in cluster.workers if node_rank is None or m.node == node_rank]
    wanted = [m for m in mine if m.device is not None and m.device.cuda]
    if not wanted:
        return backends
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for m in wanted:
        if m.local_workers > have:
            where = "this host" if node_rank is None else f"node {node_rank}"
            raise UserError(f"machine {m.name} asks for {m.local_workers} GPU(s) (gpus: {m.gpus or 1}, device.cuda: "
                            f"true) but {where} has {have} CUDA device(s); lower `gpus`, set `device.cuda: false` to "
                            "emulate the GPUs on the CPU, or run the machine on a node with enough GPUs")
    names = {m.name for m in wanted}
    needs_nccl = (backends.worker == "nccl") or any(b == "nccl" and n in names for n, b in backends.local.items())
    if needs_nccl and not torch.distributed.is_nccl_available():
        raise UserError("this job uses NCCL between GPUs (every worker has a GPU of its own, or a machine has several) "
                        "but this PyTorch build has no NCCL; install a CUDA build of PyTorch or pass --collective gloo")
    return backends


def bind(proc: Proc, describe: str) -> torch.device:
    """Bind this worker to its GPU before anything touches CUDA (torch.cuda.set_device)."""
    device = worker_device(proc)
    if device.type != "cuda":
        return device
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index >= have:
        raise UserError(f"{describe} is bound to {device} but its node has {have} CUDA device(s); "
                        "fix `gpus` / `device.cuda` for that machine in the cluster file")
    torch.cuda.set_device(device)
    return device


def nccl_environment() -> None:
    """NCCL defaults that turn a lost peer into an exception instead of a hang or an abort:
    a watchdog that, after the group's timeout, aborts the communicator without killing the
    process (the launcher names the lost rank). Waits stay stream waits: hetrain orders its
    copies after collectives by streams and events (comm/cuda.py), so it does not force
    TORCH_NCCL_BLOCKING_WAIT, which would make every wait() block the host."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
