"""Joining the job and who is who: init, rank, size, local rank, device, shutdown
(Horovod's `basics`). The one engine of this process lives here."""
from __future__ import annotations

import atexit
from typing import Callable

import torch
import torch.distributed as dist

from ..comm.engine import PushPull
from ..errors import UserError
from ..runtime import context as _context

_ENGINE: PushPull | None = None

# run first by shutdown(), with the engine still up (ops: finish outstanding async handles)
_BEFORE_SHUTDOWN: list[Callable[[PushPull], None]] = []


def init():
    """Join the job (reads the launcher's environment; a plain `python script.py` is a
    one-worker job). Returns the Context. Called again after shutdown(), it joins anew:
    every process of the job must then call it."""
    return _join(again=True)


def joined():
    """The job's Context: every call of the API joins the job the first time, as init()
    does; after shutdown() left a job of several processes, such a call is refused with
    what to do (`runtime.context.init`)."""
    return _join(again=False)


def _join(again: bool):
    global _ENGINE
    ctx = _context.init(again=again)
    if _ENGINE is None:
        if not ctx.is_worker:
            raise RuntimeError("hetrain.init() was called on a summation-server rank; servers run hetrain.comm.server")
        _ENGINE = PushPull(ctx)
        atexit.register(shutdown)
    return ctx


def engine() -> PushPull:
    if _ENGINE is None:
        joined()
    return _ENGINE


def rank() -> int:
    """This worker's index among the workers (0..size()-1)."""
    return joined().rank


def size() -> int:
    """Number of workers (summation servers are not counted)."""
    return joined().num_workers


def device() -> torch.device:
    """This worker's device: `cuda:<local rank>` on a machine with `device.cuda: true`
    (one process per GPU), else `cpu` (an emulated device, or a plain one-process run).
    Put the model there: `model.to(hetrain.device())`."""
    return joined().device


def _node_workers() -> list[int]:
    """Worker ranks started by this worker's node (launcher), in rank order."""
    ctx = joined()
    if ctx.topology is None:
        return [0]
    node = ctx.topology.proc(ctx.rank).machine.node
    return [p.rank for p in ctx.topology.workers if p.machine.node == node]


def local_rank() -> int:
    """This worker's index among the workers its node runs (Horovod/BytePS `local_rank`,
    the same number as the LOCAL_RANK variable; summation servers are not counted); on a
    CUDA worker, the index of the GPU hetrain bound it to, so a Horovod script's
    `torch.cuda.set_device(hvd.local_rank())` keeps that GPU (the two numbers are the same
    wherever each GPU has one worker; workers of machines that share a GPU share it)."""
    dev = joined().device
    if dev is not None and dev.type == "cuda":
        return dev.index
    return _node_workers().index(joined().rank)


def local_size() -> int:
    """Number of workers this worker's node runs (summation servers are not counted)."""
    return len(_node_workers())


def _nodes() -> list[str]:
    """The nodes (launchers) that run workers, in the order of their first worker."""
    ctx = joined()
    if ctx.topology is None:
        return ["local"]
    seen: list[str] = []
    for p in ctx.topology.workers:
        if p.machine.node not in seen:
            seen.append(p.machine.node)
    return seen


def cross_rank() -> int:
    """This worker's node's index among the nodes that run workers (Horovod's
    `cross_rank`: with one node per host, the host's index)."""
    ctx = joined()
    if ctx.topology is None:
        return 0
    return _nodes().index(ctx.topology.proc(ctx.rank).machine.node)


def cross_size() -> int:
    """Number of nodes that run workers (Horovod's `cross_size`)."""
    return len(_nodes())


def is_homogeneous() -> bool:
    """Whether every node runs the same number of workers (Horovod's `is_homogeneous`)."""
    ctx = joined()
    if ctx.topology is None:
        return True
    counts = [sum(p.machine.node == node for p in ctx.topology.workers) for node in _nodes()]
    return len(set(counts)) == 1


def is_initialized() -> bool:
    """Whether this process has joined the job (`hetrain.init()` ran and no shutdown since)."""
    return _ENGINE is not None


def mpi_built() -> bool:
    """hetrain never uses MPI (Horovod's build probes, for scripts that branch on them)."""
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def gloo_built() -> bool:
    """Gloo carries every host tensor (always True)."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return gloo_built()


def nccl_built() -> bool:
    """Whether this PyTorch has NCCL (hetrain uses it between the GPUs of GPU workers)."""
    return dist.is_available() and dist.is_nccl_available()


def cuda_built() -> bool:
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return torch.version.hip is not None


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def _check_root(root_rank: int, what: str) -> None:
    n = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise UserError(f"{what}: root_rank={root_rank!r} is not a worker rank; use 0..{n - 1}")


def shutdown() -> None:
    """Release the servers and the process group (called automatically at exit)."""
    global _ENGINE
    if _ENGINE is not None:
        for hook in _BEFORE_SHUTDOWN:
            hook(_ENGINE)
        eng, _ENGINE = _ENGINE, None
        try:
            if not eng.ctx.failed:
                eng.shutdown()
        finally:
            _context.shutdown()
