"""The user API, modelled on Horovod/BytePS so existing scripts port in a few lines."""
from __future__ import annotations

import atexit

import torch
import torch.distributed as dist

from .comm.engine import PushPull
from .errors import UserError
from .runtime import context as _context

_ENGINE: PushPull | None = None


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


def push_pull(named: list[tuple[str, torch.Tensor]], batch_size: int = 1, average: bool = True) -> None:
    """Batch-weighted average (or sum) of the named tensors over all workers, in place."""
    engine().push_pull(named, weight=batch_size, average=average)


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Copy root's parameters (a state_dict, named_parameters() or list of tensors) to all workers."""
    ctx = init()
    if not ctx.distributed:
        return
    if isinstance(params, dict):
        tensors = [t for t in params.values() if isinstance(t, torch.Tensor)]
    else:
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    try:
        dist.broadcast(flat, src=root_rank, group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error("broadcasting parameters", [root_rank], err) from None
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off: off + n].view_as(t).to(t.dtype))
            off += n


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer: `step()` first averages gradients over workers, weighted by
    each worker's batch size (`set_batch_size`, default 1 = equal weights).

    With `overlap=True` (default: the job's `--overlap`), each parameter's gradient is
    pushed as soon as backward has accumulated it, while backward goes on with the
    layers before it; `step()` then only waits for what is still in flight. Call
    `zero_grad()` once per step (it arms the hooks), then `set_batch_size` before
    `backward()` (it exchanges the step header, so the hooks only send); one backward
    per step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, overlap: bool | None = None):
        self._inner = optimizer
        if named_parameters is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            named_parameters = [(f"param.{i}", p) for i, p in enumerate(params)]
        self._named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in self._named]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters has duplicate names; pass model.named_parameters()")
        self._batch_size = 1
        self.engine = engine()
        self.sync = self.engine.ctx.comm.sync if self.engine.ctx.distributed else "sync"
        self._async = None  # AsyncClient, made at the first step (after any checkpoint load)
        self.overlap = (self.engine.ctx.comm.overlap if overlap is None else bool(overlap)) and self.sync == "sync"
        self._armed = False
        self._hooks = []
        if self.overlap:
            index = {id(p): i for i, (_, p) in enumerate(self._named)}
            for _, p in self._named:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param, i=index[id(p)]: self._grad_ready(i, param)))

    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Backward produced parameter i's gradient: start pushing it now."""
        if not self._armed:
            return
        if not self.engine.in_flight:
            if not self.engine.begin(self._named, weight=self._batch_size, overlapped=True):
                self._armed = False
                return
        if self.engine.is_ready(i):
            raise UserError(f"parameter {self._named[i][0]!r} got a second gradient in one step: overlap pushes each "
                            "gradient as soon as backward produces it, so it supports one backward per step; "
                            "drop --overlap (or overlap=False) to accumulate gradients over several backwards")
        self.engine.ready(i, param.grad)

    def __getattr__(self, item):  # delegate everything else (param_groups, state...)
        if item.startswith("_"):
            raise AttributeError(item)
        return getattr(self._inner, item)

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    def set_batch_size(self, batch_size: int) -> None:
        self._batch_size = int(batch_size)
        if self._armed and not self.engine.in_flight:
            # overlap: exchange the step header now, before backward, so the hooks only
            # send (waiting for the other workers must not count as this worker's compute,
            # or the balancer would read waiting as slowness)
            if not self.engine.begin(self._named, weight=self._batch_size, overlapped=True):
                self._armed = False

    def synchronize(self) -> None:
        named = []
        for n, p in self._named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            named.append((n, p.grad))
        self._armed = False
        if self.engine.in_flight:  # overlap: most partitions are already on their way
            self.engine.finish([t for _, t in named])
        else:
            self.engine.push_pull(named, weight=self._batch_size)

    def step(self, closure=None):
        if self.sync != "sync":  # async / bounded staleness: the servers run SGD on the pushes
            from .comm.async_ps import AsyncClient

            loss = closure() if closure is not None else None
            group = self._inner.param_groups[0]
            if self._async is None:
                self._async = AsyncClient(self.engine.ctx, self._named, group["lr"], group.get("momentum", 0.0))
            self._async.step(lr=group["lr"], batch_size=self._batch_size)
            return loss
        self.synchronize()
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)
        self._armed = self.overlap

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._inner.load_state_dict(state_dict)


class HookState:
    """State for `ddp_comm_hook`: set `batch_size` each step for weighted averaging."""

    def __init__(self, batch_size: int = 1):
        self.batch_size = batch_size


def ddp_comm_hook(state: HookState, bucket) -> torch.futures.Future:
    """DDP communication hook: `model.register_comm_hook(HookState(), hetrain.ddp_comm_hook)`
    sends DDP's gradient buckets through push_pull (any mode) instead of all-reduce."""
    buf = bucket.buffer()
    engine().push_pull([(f"ddp.bucket{bucket.index()}", buf)], weight=state.batch_size)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP inspects these annotations literally; postponed (string) annotations fail its check.
ddp_comm_hook.__annotations__.update(bucket=dist.GradBucket, state=HookState,
                                     **{"return": torch.futures.Future[torch.Tensor]})


def shutdown() -> None:
    """Release the servers and the process group (called automatically at exit)."""
    global _ENGINE
    if _ENGINE is not None:
        eng, _ENGINE = _ENGINE, None
        try:
            if not eng.ctx.failed:
                eng.shutdown()
        finally:
            _context.shutdown()
