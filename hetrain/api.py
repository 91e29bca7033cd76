"""The user API, modelled on Horovod/BytePS so existing scripts port in a few lines."""
from __future__ import annotations

import atexit
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .comm import p2p
from .comm.engine import PushPull, check_tensors
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


def device() -> torch.device:
    """This worker's device: `cuda:<local rank>` on a machine with `device.cuda: true`
    (one process per GPU), else `cpu` (an emulated device, or a plain one-process run).
    Put the model there: `model.to(hetrain.device())`."""
    return init().device


def push_pull(named: list[tuple[str, torch.Tensor]], batch_size: int = 1, average: bool = True) -> None:
    """Batch-weighted average (or sum) of the named tensors over all workers, in place."""
    engine().push_pull(named, weight=batch_size, average=average)


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Copy root's parameters (a state_dict, named_parameters() or list of tensors) to all
    workers, tensor by tensor, each in its own dtype and on its own device (its raw bytes
    travel, so every dtype arrives exact and nothing is converted). CUDA tensors go over
    NCCL where the workers have it, else through a host copy (gloo takes host memory
    only)."""
    ctx = init()
    if not ctx.distributed:
        return
    if isinstance(params, dict):
        items = [(k, t) for k, t in params.items() if isinstance(t, torch.Tensor)]
    else:
        items = [(p[0], p[1]) if isinstance(p, tuple) else (f"tensor {i}", p) for i, p in enumerate(params)]
    with torch.no_grad():
        for name, t in items:
            _broadcast_one(ctx, name, t, root_rank)


def _broadcast_one(ctx, name: str, t: torch.Tensor, root: int) -> None:
    if t.device.type not in ("cpu", "cuda"):
        raise UserError(f"broadcast_parameters: {name!r} is on {t.device}, which holds no data; materialise it first")
    if t.numel() == 0:
        return
    data = t.detach()
    flat = data.reshape(-1) if data.is_contiguous() else data.contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    nccl = t.device.type == "cuda" and ctx.nccl_group is not None
    buf = raw if (t.device.type == "cpu" or nccl) else raw.to("cpu")  # gloo: a host copy of the bytes
    try:
        if nccl:
            dist.broadcast(buf, src=root, group=ctx.nccl_group)
        else:
            dist.broadcast(p2p.host_only(buf, f"broadcasting {name!r}"), src=root, group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error(f"broadcasting parameter {name!r}", [root], err) from None
    if buf is not raw:
        raw.copy_(buf)
    if not data.is_contiguous():  # the bytes landed in a contiguous copy
        data.copy_(flat.view_as(data))


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer: `step()` first averages gradients over workers, weighted by
    each worker's batch size (`set_batch_size`, default 1 = equal weights).

    With `overlap=True` (default: the job's `--overlap`), each parameter's gradient is
    pushed as soon as backward has accumulated it, while backward goes on with the
    layers before it; `step()` then only waits for what is still in flight. Call
    `zero_grad()` once per step (it arms the hooks), then `set_batch_size` before
    `backward()` (it exchanges the step header, so the hooks only send); one backward
    per step.

    On a GPU worker (model on `hetrain.device()`) the hooks only record an event and
    queue a copy to pinned host memory (no host sync inside backward); `step()` makes the
    compute stream wait for the results.

    To change gradients between the exchange and the update (clipping), as in Horovod:
    `opt.synchronize()`, clip, then `with opt.skip_synchronize(): opt.step()`.
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
        if self.engine.ctx.distributed:  # the model on this worker's device (or the host), before any step
            check_tensors(self._named, self.engine.ctx.device, "DistributedOptimizer: parameter", model=True)
        self.sync = self.engine.ctx.comm.sync if self.engine.ctx.distributed else "sync"
        self._async = None  # AsyncClient, made at the first step (after any checkpoint load)
        self.overlap = (self.engine.ctx.comm.overlap if overlap is None else bool(overlap)) and self.sync == "sync"
        self._armed = False
        self._synced = False  # gradients of this step already exchanged (synchronize())
        self._skip = False
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
        """Average the gradients over the workers now (step() does it unless it already
        happened this step, or inside skip_synchronize())."""
        if self.sync != "sync":
            raise UserError(f"synchronize() exchanges gradients synchronously but this job runs sync={self.sync!r}, "
                            "where step() pushes them to the parameter servers")
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
        self._synced = True

    @contextmanager
    def skip_synchronize(self):
        """`step()` inside this block runs the optimizer without exchanging gradients
        (call synchronize() first), e.g. to clip the averaged gradients in between."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if self.sync != "sync":  # async / bounded staleness: the servers run SGD on the pushes
            from .comm.async_ps import AsyncClient

            loss = closure() if closure is not None else None
            group = self._inner.param_groups[0]
            if self._async is None:
                self._async = AsyncClient(self.engine.ctx, self._named, group["lr"], group.get("momentum", 0.0),
                                          batch=self._batch_size)
            self._async.step(lr=group["lr"], batch_size=self._batch_size)
            return loss
        if not self._skip and not self._synced:
            self.synchronize()
        elif self._skip and not self._synced and self.engine.ctx.distributed:
            raise UserError("step() inside skip_synchronize() needs synchronize() first: without it the workers' "
                            "gradients were never averaged")
        self._synced = False
        return self._inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)
        self._armed = self.overlap
        self._synced = False

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._inner.load_state_dict(state_dict)


class HookState:
    """State for `ddp_comm_hook`: set `batch_size` each step for weighted averaging.

    The hook treats DDP's buckets of one iteration as consecutive pieces of one flat
    gradient (DDP gives every rank the same buckets in the same order), so DDP's bucket
    rebuild after the first iteration changes nothing hetrain's servers see."""

    def __init__(self, batch_size: int = 1):
        self.batch_size = batch_size
        self.numel: int | None = None  # gradient elements per iteration (learned in the first)
        self.flat: torch.Tensor | None = None  # the iteration's buckets, back to back
        self.pieces: list = []  # (bucket buffer, offset, future) of this iteration
        self.offset = 0


def ddp_comm_hook(state: HookState, bucket) -> torch.futures.Future:
    """DDP communication hook: `model.register_comm_hook(HookState(), hetrain.ddp_comm_hook)`
    sends DDP's gradient buckets through push_pull (any mode) instead of all-reduce.

    Each bucket is handed to the engine as soon as DDP has it (its partitions leave while
    backward goes on) and the hook returns at once with a Future on the bucket's device;
    the futures complete when the sums are back (at the iteration's last bucket). The
    first iteration learns the buckets' total size and exchanges them in one push_pull."""
    eng = engine()
    buf = bucket.buffer()
    fut: torch.futures.Future = torch.futures.Future(devices=[buf.device] if buf.device.type == "cuda" else None)
    if bucket.index() == 0:
        state.pieces, state.offset = [], 0
        if state.numel is not None:
            if state.flat is None or state.flat.device != buf.device or state.flat.dtype != buf.dtype:
                state.flat = torch.empty(state.numel, dtype=buf.dtype, device=buf.device)
            # buckets fill the flat buffer front to back: collectives follow that order
            eng.begin([("ddp.grads", state.flat)], weight=state.batch_size, overlapped=True, arrival="forward")
    n = buf.numel()
    lo = state.offset
    state.pieces.append((buf, lo, fut))
    state.offset += n
    if state.numel is not None:
        if state.offset > state.numel:
            raise UserError(f"ddp_comm_hook: DDP's buckets hold more than the {state.numel} gradient elements of "
                            "the first iteration; use one HookState per DDP model")
        state.flat[lo: lo + n].copy_(buf)
        eng.ready(0, state.flat, lo, lo + n)
    if not bucket.is_last():
        return fut
    if state.numel is None:  # first iteration: learn the size, exchange everything at once
        state.numel = state.offset
        state.flat = torch.cat([b.reshape(-1) for b, _, _ in state.pieces])
        eng.push_pull([("ddp.grads", state.flat)], weight=state.batch_size)
    elif state.offset != state.numel:
        raise UserError(f"ddp_comm_hook: DDP's buckets held {state.offset} gradient elements this iteration, "
                        f"{state.numel} in the first; use one HookState per DDP model")
    else:
        eng.finish([state.flat])
    for b, off, f in state.pieces:
        b.copy_(state.flat[off: off + b.numel()].view_as(b))
        f.set_result(b)
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
