"""push_pull and its asynchronous form (BytePS's `push_pull`/`push_pull_async`,
Horovod's `allreduce_async` + `synchronize`/`poll`): the tensor operations that run on
the engine (comm/engine.py), so on every transport push_pull has."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from .basics import _BEFORE_SHUTDOWN, engine

def _as_named(tensor, name: str | None) -> tuple[torch.Tensor, str]:
    if not isinstance(tensor, torch.Tensor):
        raise UserError(f"push_pull: tensor must be a torch.Tensor or a list of (name, tensor) pairs, "
                        f"got {type(tensor).__name__}")
    return tensor, name or "push_pull.tensor"


def push_pull(tensor, average: bool = True, name: str | None = None, batch_size: int = 1):
    """Batch-weighted average (or, with `average=False`, the sum) over all workers.

    BytePS/Horovod form: `push_pull(tensor, average=True, name=None)` returns a new
    tensor with the result and leaves `tensor` unchanged. hetrain's form: a list of
    `(name, tensor)` pairs is reduced in place (returns None), in priority order (first
    = sent first). `batch_size` is this worker's batch (weights the average). Every
    worker must make the same calls with the same names and shapes. Outstanding
    `push_pull_async` handles are completed first.
    """
    _drain()
    if isinstance(tensor, (list, tuple)):
        engine().push_pull(list(tensor), weight=batch_size, average=average, speculate=True)
        return None
    t, label = _as_named(tensor, name)
    out = t.detach().clone()
    engine().push_pull([(label, out)], weight=batch_size, average=average, speculate=True)
    return out


@dataclass
class _Request:
    named: list
    batch_size: int
    average: bool
    started: bool = False
    done: bool = False

    @property
    def out(self) -> torch.Tensor:
        return self.named[0][1]


_PENDING: list[_Request] = []  # issued by push_pull_async, not yet finished, in issue order
_HANDLES: dict[int, _Request] = {}  # handle -> request, until synchronize collects it
_NEXT_HANDLE = [0]


def _start(req: _Request) -> None:
    eng = engine()
    req.started = True
    if not eng.begin(req.named, weight=req.batch_size, average=req.average, speculate=True):
        req.done = True  # nothing to move (one worker): the result is the input
        return
    for i, (_, t) in enumerate(req.named):
        eng.ready(i, t)


def _complete_through(req: _Request) -> None:
    """Finish the outstanding operations in issue order up to and including `req`."""
    eng = engine()
    while _PENDING and not req.done:
        head = _PENDING[0]
        if not head.started:
            _start(head)
        if not head.done:
            eng.finish([t for _, t in head.named])
            head.done = True
        _PENDING.pop(0)
        if _PENDING and not _PENDING[0].started:
            _start(_PENDING[0])  # its partitions travel while the caller goes on


def _drain() -> None:
    if _PENDING:
        _complete_through(_PENDING[-1])


def push_pull_async(tensor, average: bool = True, name: str | None = None, batch_size: int = 1) -> int:
    """Start a push_pull of `tensor` and return a handle at once (Horovod's
    `allreduce_async`, BytePS's `push_pull_async`); `synchronize(handle)` returns the
    result, a new tensor (`tensor` itself is not changed and may be reused at once).

    The partitions are posted as soon as the call is made, so they travel while the
    caller computes. hetrain's engine has one push_pull in flight at a time: several
    outstanding handles are served one after another in the order they were issued
    (finishing a handle finishes the earlier ones first, then posts the next), which
    gives the same results as the same calls made synchronously. Every worker must issue
    the same sequence of calls (names and shapes), as with push_pull.
    """
    t, label = _as_named(tensor, name)
    eng = engine()  # joins the job
    if not _PENDING:
        eng.complete_other()  # a DistributedOptimizer's exchange in flight completes first
    req = _Request([(label, t.detach().clone())], int(batch_size), bool(average))
    _PENDING.append(req)
    if len(_PENDING) == 1:
        _start(req)
        if req.done:
            _PENDING.pop(0)
    return new_handle(req)


class Outstanding:
    """A collective's handle (hetrain.allreduce_async and the like): `poll()` says
    whether it is done, `wait()` finishes it and returns its result."""

    def poll(self) -> bool:
        raise NotImplementedError

    def wait(self):
        raise NotImplementedError


def new_handle(req) -> int:
    """Register an outstanding operation (a push_pull_async request or a collective's
    Outstanding) and return its handle for poll/synchronize."""
    handle = _NEXT_HANDLE[0] = _NEXT_HANDLE[0] + 1
    _HANDLES[handle] = req
    return handle


def _request(handle: int, what: str):
    req = _HANDLES.get(handle)
    if req is None:
        raise UserError(f"{what}: unknown handle {handle!r} (already synchronized, or not from an *_async call)")
    return req


def poll(handle: int) -> bool:
    """True when `synchronize(handle)` will return without waiting.

    hetrain has no background communication thread, so the work is driven from here:
    when the handle is still outstanding, poll finishes it (and the handles issued
    before it), waiting for its last partitions, and returns True. A
    `while not poll(h)` loop therefore ends at its first call."""
    req = _request(handle, "poll")
    if isinstance(req, Outstanding):
        return req.poll()
    _complete_through(req)
    return True


def synchronize(handle: int) -> torch.Tensor:
    """Wait for a handle of `push_pull_async` (or of an `allreduce_async`-style
    collective) and return its result (each handle once)."""
    req = _request(handle, "synchronize")
    if isinstance(req, Outstanding):
        del _HANDLES[handle]
        return req.wait()
    _complete_through(req)
    del _HANDLES[handle]
    return req.out


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None,
                      batch_size: int = 1) -> torch.Tensor:
    """BytePS's `push_pull_inplace`: reduce `tensor` over the workers in place and return it."""
    t, label = _as_named(tensor, name)
    push_pull([(label, t)], average=average, batch_size=batch_size)
    return t


def declare(name: str, **kwargs) -> None:
    """BytePS's `declare(name)`: register a tensor name before use so that every worker
    assigns it the same key. hetrain agrees on names and layouts at each push_pull (the
    step header), so nothing needs declaring; the name is checked and accepted."""
    if not isinstance(name, str) or not name:
        raise UserError(f"declare: name must be a non-empty string, got {name!r}")


def suspend() -> None:
    """BytePS's `suspend()` (before a resize in its elastic mode): finish outstanding
    async operations so nothing is in flight. hetrain resizes by restarting rounds
    (hetrain.elastic), so nothing else has to pause."""
    _drain()


def resume(num_workers: int | None = None, num_servers: int | None = None, global_rank: int | None = None,
           context=None) -> None:
    """BytePS's `resume(...)` after `suspend()`: the job's size comes from the launcher's
    round, so the arguments are checked against it, not applied."""
    eng = engine()
    have = eng.ctx.num_workers
    if num_workers is not None and int(num_workers) != have:
        raise UserError(f"resume(num_workers={num_workers}): this round of the job has {have} workers; hetrain "
                        "changes the number of workers by restarting the job from its last commit "
                        "(hetrain.elastic, launcher --min-workers / --max-restarts)")


def _finish_at_shutdown(eng) -> None:
    """push_pull_async handles never synchronized: finish them like every other worker."""
    if _PENDING and not eng.ctx.failed:
        _drain()
    _HANDLES.clear()


_BEFORE_SHUTDOWN.append(_finish_at_shutdown)
