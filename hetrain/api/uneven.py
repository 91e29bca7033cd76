"""`hetrain.join()`: workers with fewer batches than the others stop early without
hanging the rest (Horovod's `hvd.join`, what PyTorch's `Join` context does for DDP).

A worker that calls `join()` has run out of data. Until every worker has joined, it
shadows the others' operations: before each join-aware operation (the allreduce family,
barrier, and each DistributedOptimizer exchange) the workers still training all-reduce
one small descriptor of what they are about to do; a joined worker takes part in that
all-reduce with zeros, reads the descriptor and runs the same operation with a
contribution that changes nothing (zeros to a sum or an average, the identity of
min/max/product, batch weight 0 to the optimizer's weighted average). An average is
taken over the workers that have not joined. `join()` returns, on every worker, the
rank that joined last.

The descriptor costs one tiny all-reduce per such operation (DDP's Join pays the same).
Steps whose batch comes from a `BalancedLoader` (the optimizer's `set_batch_size` with a
`total`) pay nothing: the loader's contract is that every worker takes every step (its
own per-step exchange admits no joined worker), so their exchange is not announced.
Other collectives (allgather, broadcast, alltoall, reducescatter) are refused with a
clear error on every worker while one of them has joined. Not shadowed: SyncBatchNorm's
statistics and a GradScaler's inf/NaN agreement (a joined worker runs no forward pass),
and the broadcasts of parameters, optimizer state and objects; call those when every
worker is in.
"""
from __future__ import annotations

import enum
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import UserError
from .basics import _BEFORE_SHUTDOWN, joined

# descriptor: [active, kind, a, b, c, stopping]; active workers send identical ones, joined
# workers zeros, a worker leaving the job (shutdown) only stopping = 1
_WIDTH = 6


class Kind(enum.IntEnum):
    NOTHING = 0  # a check with no operation after it (the optimizer's zero_grad)
    ALLREDUCE = 1  # a = op index, b = dtype index, c = numel
    BARRIER = 2
    OPTIMIZER = 3  # a = optimizer index (creation order)
    REFUSED = 4  # an operation join cannot shadow: every worker raises


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_OPTIMIZERS: list = []  # DistributedOptimizers, in creation order (the same on every worker)
_SHADOWS: dict[Kind, Callable] = {}  # kind -> what a joined worker runs (registered by the modules that own them)
_seen = [0]  # checks this worker took part in (identifies the last joiner)


def dtype_index(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise UserError(f"hetrain collectives do not move {dtype} tensors; use one of "
                        f"{', '.join(str(d) for d in _DTYPES)}")
    return _DTYPES.index(dtype)


def dtype_of(index: int) -> torch.dtype:
    return _DTYPES[index]


def register_optimizer(opt) -> int:
    _OPTIMIZERS.append(opt)
    return len(_OPTIMIZERS) - 1


def _exchange(desc: list[int], stopping: int = 0) -> tuple[int, list[int]]:
    """All-reduce one descriptor; returns (active workers, the active workers' descriptor).
    Raises on every worker when some workers are leaving the job while others are not."""
    ctx = joined()
    t = torch.tensor(desc + [0] * (_WIDTH - 1 - len(desc)) + [stopping], dtype=torch.int64)
    try:
        dist.all_reduce(t, group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error("agreeing which workers have joined", [], err) from None
    _seen[0] += 1
    active, leaving = int(t[0]), int(t[-1])
    if 0 < leaving < ctx.num_workers:
        ctx.failed = True  # no goodbye collectives: the others are not at theirs
        raise UserError(f"{leaving} of {ctx.num_workers} workers ended the job while the others went on training: "
                        "every worker must run the same number of steps, or call hetrain.join() when it runs out "
                        "of data (the others then finish without it)")
    return active, [int(v) // active for v in t[1:-1]] if active else [0] * (_WIDTH - 2)


def announce(kind: Kind, *args: int) -> int:
    """Called by an active worker before a join-aware operation: tell the joined workers
    what follows. Returns the number of workers that have not joined (this one included)."""
    ctx = joined()
    if not ctx.distributed or ctx.num_workers == 1:
        return 1
    active, _ = _exchange([1, int(kind), *args])
    return active


def refuse_if_joined(what: str) -> None:
    """Operations join cannot shadow: refused on every worker while one has joined."""
    ctx = joined()
    if not ctx.distributed or ctx.num_workers == 1:
        return
    active = announce(Kind.REFUSED)
    if active < ctx.num_workers:
        raise UserError(f"{what} cannot run while {ctx.num_workers - active} worker(s) have called hetrain.join(); "
                        "only allreduce, barrier and DistributedOptimizer steps continue after a join")


def join(device: int = -1) -> int:
    """This worker has no more data: shadow the others' operations until all have
    joined (see the module docstring). Returns the rank that joined last. `device` is
    accepted for Horovod compatibility (hetrain picks the transport by tensor device)."""
    ctx = joined()
    if not ctx.distributed or ctx.num_workers == 1:
        return 0
    joined_at = _seen[0]
    while True:
        active, desc = _exchange([0])
        if active == 0:
            break
        kind = Kind(desc[0])
        if kind == Kind.REFUSED:
            raise UserError("another worker ran a collective that cannot run after hetrain.join() (allgather, "
                            "broadcast, alltoall or reducescatter); only allreduce, barrier and DistributedOptimizer "
                            "steps continue after a join")
        shadow = _SHADOWS.get(kind)
        if shadow is not None:
            shadow(desc[1:], active)
    # the last to join saw the most checks; ties go to the highest rank
    last = torch.tensor([joined_at * ctx.num_workers + ctx.rank], dtype=torch.int64)
    try:
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error("finding the last worker to join", [], err) from None
    return int(last) % ctx.num_workers


def _leave(eng) -> None:
    """At shutdown, once a DistributedOptimizer exists (its steps announce themselves):
    tell the workers still training, whose next announcement would otherwise wait for
    this worker, that it left; they stop with a clear error instead of a timeout."""
    ctx = eng.ctx
    if _OPTIMIZERS and ctx.distributed and ctx.num_workers > 1 and not ctx.failed:
        _exchange([0], stopping=1)


def _shadow_optimizer(args: list[int], active: int) -> None:
    _OPTIMIZERS[args[0]]._shadow_exchange()


def _shadow_barrier(args: list[int], active: int) -> None:
    ctx = joined()
    try:
        dist.barrier(group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error("barrier", [], err) from None


_SHADOWS[Kind.OPTIMIZER] = _shadow_optimizer
_SHADOWS[Kind.BARRIER] = _shadow_barrier
_BEFORE_SHUTDOWN.append(_leave)
