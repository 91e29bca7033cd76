"""Joining the job and who is who: init, rank, size, local rank, device, shutdown
(Horovod's `basics`). The one engine of this process lives here."""
from __future__ import annotations

import atexit
from typing import Callable

import torch

from ..comm.engine import PushPull
from ..errors import UserError
from ..runtime import context as _context

_ENGINE: PushPull | None = None

# run first by shutdown(), with the engine still up (ops: finish outstanding async handles)
_BEFORE_SHUTDOWN: list[Callable[[PushPull], None]] = []


def init():
    """Join the job (reads the launcher's environment; a plain `python script.py` is a
    one-worker job). Returns the Context."""
    global _ENGINE
    ctx = _context.init()
    if _ENGINE is None:
        if not ctx.is_worker:
            raise RuntimeError("hetrain.init() was called on a summation-server rank; servers run hetrain.comm.server")
        _ENGINE = PushPull(ctx)
        atexit.register(shutdown)
    return ctx


def engine() -> PushPull:
    if _ENGINE is None:
        init()
    return _ENGINE


def rank() -> int:
    """This worker's index among the workers (0..size()-1)."""
    return init().rank


def size() -> int:
    """Number of workers (summation servers are not counted)."""
    return init().num_workers


def device() -> torch.device:
    """This worker's device: `cuda:<local rank>` on a machine with `device.cuda: true`
    (one process per GPU), else `cpu` (an emulated device, or a plain one-process run).
    Put the model there: `model.to(hetrain.device())`."""
    return init().device


def _node_workers() -> list[int]:
    """Worker ranks started by this worker's node (launcher), in rank order."""
    ctx = init()
    if ctx.topology is None:
        return [0]
    node = ctx.topology.proc(ctx.rank).machine.node
    return [p.rank for p in ctx.topology.workers if p.machine.node == node]


def local_rank() -> int:
    """This worker's index among the workers its node runs (Horovod/BytePS `local_rank`,
    the same number as the LOCAL_RANK variable). Summation servers are not counted. For
    the GPU to use, ask `hetrain.device()`: hetrain has already bound it (on an embedded
    cluster several emulated machines of one host may share a GPU index)."""
    return _node_workers().index(init().rank)


def local_size() -> int:
    """Number of workers this worker's node runs (summation servers are not counted)."""
    return len(_node_workers())


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
