"""The user API, modelled on Horovod/BytePS so existing scripts port in a few lines."""
from __future__ import annotations

import atexit
from contextlib import contextmanager
from dataclasses import dataclass

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
        engine().push_pull(list(tensor), weight=batch_size, average=average)
        return None
    t, label = _as_named(tensor, name)
    out = t.detach().clone()
    engine().push_pull([(label, out)], weight=batch_size, average=average)
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
    if not eng.begin(req.named, weight=req.batch_size, average=req.average):
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
    if eng.in_flight and not _PENDING:
        raise UserError("push_pull_async: a DistributedOptimizer exchange is in flight (--overlap); call "
                        "optimizer.step() or synchronize() first")
    req = _Request([(label, t.detach().clone())], int(batch_size), bool(average))
    _PENDING.append(req)
    if len(_PENDING) == 1:
        _start(req)
        if req.done:
            _PENDING.pop(0)
    handle = _NEXT_HANDLE[0] = _NEXT_HANDLE[0] + 1
    _HANDLES[handle] = req
    return handle


def _request(handle: int, what: str) -> _Request:
    req = _HANDLES.get(handle)
    if req is None:
        raise UserError(f"{what}: unknown handle {handle!r} (already synchronized, or not from push_pull_async)")
    return req


def poll(handle: int) -> bool:
    """True when `synchronize(handle)` will return without waiting.

    hetrain has no background communication thread, so the work is driven from here:
    when the handle is still outstanding, poll finishes it (and the handles issued
    before it), waiting for its last partitions, and returns True. A
    `while not poll(h)` loop therefore ends at its first call."""
    req = _request(handle, "poll")
    _complete_through(req)
    return True


def synchronize(handle: int) -> torch.Tensor:
    """Wait for a `push_pull_async` handle and return its result (each handle once)."""
    req = _request(handle, "synchronize")
    _complete_through(req)
    del _HANDLES[handle]
    return req.out


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


def _broadcast_bytes(data: bytes | None, error: str | None, root_rank: int, what: str) -> bytes:
    """Root sends `data` (or, when it refused the object, `error`) to every worker;
    a refusal is raised as the same UserError on every rank."""
    ctx = init()
    me = ctx.rank == root_rank
    head = torch.zeros(2, dtype=torch.int64)
    if me:
        payload = (error or "").encode() if error is not None else data
        head[0], head[1] = len(payload), int(error is not None)
    try:
        dist.broadcast(head, src=root_rank, group=ctx.worker_group)
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if me and len(payload)
               else torch.empty(int(head[0]), dtype=torch.uint8))
        if int(head[0]):
            dist.broadcast(buf, src=root_rank, group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error(what, [root_rank], err) from None
    received = bytes(buf.numpy().tobytes())
    if int(head[1]):
        raise UserError(f"{received.decode(errors='replace')} (refused on rank {root_rank}, the root of {what})")
    return received


def broadcast_object(obj=None, root_rank: int = 0, name: str | None = None):
    """Return root's `obj` on every worker (Horovod's `broadcast_object`). Every worker
    calls it; the others' `obj` is ignored.

    Nothing is pickled: the object may hold tensors, numbers, strings, bytes, None and
    list/tuple/dict/set of them (`hetrain/objects.py`); anything else is refused with a
    UserError, on every rank. Root gets its own object back; the others get a copy
    (tensors on the CPU). `name` is accepted for Horovod compatibility.
    """
    from . import objects

    ctx = init()
    _check_root(root_rank, "broadcast_object")
    if ctx.rank == root_rank:
        data, error = None, None
        try:
            data = objects.encode(obj)
        except UserError as err:
            error = str(err)
        if not ctx.distributed:
            if error is not None:
                raise UserError(error)
            return obj
        _broadcast_bytes(data, error, root_rank, "broadcasting an object")
        return obj
    return objects.decode(_broadcast_bytes(None, None, root_rank, "broadcasting an object"))


_TENSOR_KEY = "__hetrain_tensor__"
_WIRE_DTYPE = {torch.bool: torch.uint8}  # gloo has no bool: sent as bytes


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every worker's optimizer state (momentum buffers, Adam moments, step counts,
    hyper-parameters) equal to root's (Horovod/BytePS `broadcast_optimizer_state`).

    Root's state_dict is sent as its structure (numbers, flags, ids) through
    `broadcast_object` and its tensors one by one, each in its own dtype; the others
    load it with `load_state_dict`, so a worker whose optimizer has not stepped yet (no
    state) gets root's state too. The optimizers must be built over the same parameters
    in the same order. Works on a DistributedOptimizer or a plain optimizer.
    """
    ctx = init()
    _check_root(root_rank, "broadcast_optimizer_state")
    if not ctx.distributed:
        return
    me = ctx.rank == root_rank
    tensors: list[torch.Tensor] = []

    def strip(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return {_TENSOR_KEY: [len(tensors) - 1, str(x.dtype).removeprefix("torch."), list(x.shape)]}
        if isinstance(x, dict):
            return type(x)((k, strip(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v) for v in x)
        return x

    skeleton = strip(optimizer.state_dict()) if me else None
    skeleton = broadcast_object(skeleton, root_rank)
    specs = []

    def collect(x):
        if isinstance(x, dict) and set(x) == {_TENSOR_KEY}:
            specs.append(x[_TENSOR_KEY])
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(skeleton)
    received: dict[int, torch.Tensor] = {}
    for i, dtype_name, shape in sorted(specs):
        dtype = getattr(torch, dtype_name)
        wire = _WIRE_DTYPE.get(dtype, dtype)
        buf = (tensors[i].to("cpu", wire).contiguous().clone() if me
               else torch.empty(shape, dtype=wire))
        try:
            dist.broadcast(buf, src=root_rank, group=ctx.worker_group)
        except RuntimeError as err:
            raise ctx.peer_error("broadcasting optimizer state", [root_rank], err) from None
        received[i] = buf.to(dtype)
    if me:
        return

    def fill(x):
        if isinstance(x, dict) and set(x) == {_TENSOR_KEY}:
            return received[x[_TENSOR_KEY][0]]
        if isinstance(x, dict):
            return type(x)((k, fill(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x

    try:
        optimizer.load_state_dict(fill(skeleton))
    except (ValueError, KeyError) as err:
        raise UserError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer state does not fit this "
                        f"worker's optimizer ({err}); build the same optimizer over the same parameters on "
                        "every worker") from None


class Compression:
    """Gradient compression names for `DistributedOptimizer(compression=...)`, as in
    Horovod and BytePS (`Compression.none`, `Compression.fp16`), plus hetrain's codecs.
    A codec is a job setting (`hetrain launch --codec`): the summation servers decode
    with it, so an optimizer may only ask for the codec the job runs."""

    none = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"
    auto = "auto"


# Horovod's and BytePS's compressor classes, by name
_FOREIGN_CODECS = {"NoneCompressor": "fp32", "FP16Compressor": "fp16"}


def _codec_name(compression) -> str:
    if isinstance(compression, str):
        name = {"none": "fp32"}.get(compression.lower(), compression.lower())
    else:
        label = getattr(compression, "__name__", type(compression).__name__)
        name = _FOREIGN_CODECS.get(label)
        if name is None:
            raise UserError(f"compression={compression!r} is not a codec hetrain knows; use hetrain.Compression.none, "
                            ".fp16, .int8, .int4 or .auto (or Horovod's/BytePS's Compression.none / .fp16)")
    from .comm.compress import CODECS

    if name not in CODECS + ("auto",):
        raise UserError(f"compression={compression!r}: unknown codec {name!r}; choose one of "
                        f"{', '.join(CODECS + ('auto',))}")
    return name


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer: `step()` first averages gradients over workers, weighted by
    each worker's batch size (`set_batch_size`, default 1 = equal weights).

    With `overlap=True` (default: the job's `--overlap`; always in mode allreduce, as in
    PyTorch DDP, whose bucketed all-reduce runs during backward), each parameter's gradient is
    pushed as soon as backward has accumulated it, while backward goes on with the
    layers before it; `step()` then only waits for what is still in flight. Call
    `zero_grad()` once per step (it arms the hooks), then `set_batch_size` before
    `backward()` (it exchanges the step header, so the hooks only send).

    On a GPU worker (model on `hetrain.device()`) the hooks only record an event and
    queue a copy to pinned host memory (no host sync inside backward); `step()` makes the
    compute stream wait for the results.

    `backward_passes_per_step=N` (Horovod's meaning): N backward passes accumulate
    their gradients locally and the exchange happens on the N-th (with overlap, from
    the N-th pass's hooks); call `step()` after every N backwards. Gradients are summed
    over the passes, as in plain PyTorch: scale each loss by 1/N for the mean over the
    N micro-batches. `compression` (Horovod's `Compression.none/fp16` or hetrain's
    `Compression.int8/int4/auto`) must name the codec the job runs (`--codec`), since
    the summation servers decode with it; another one raises a UserError.
    To change gradients between the exchange and the update (clipping), as in Horovod:
    `opt.synchronize()`, clip, then `with opt.skip_synchronize(): opt.step()` (a step()
    after synchronize() never exchanges a second time).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, overlap: bool | None = None,
                 compression=None, backward_passes_per_step: int = 1):
        self._inner = optimizer
        if named_parameters is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            named_parameters = [(f"param.{i}", p) for i, p in enumerate(params)]
        self._named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in self._named]
        if len(set(names)) != len(names):
            raise UserError("named_parameters has duplicate names; pass model.named_parameters()")
        if (isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int)
                or backward_passes_per_step < 1):
            raise UserError(f"backward_passes_per_step={backward_passes_per_step!r} must be an integer >= 1 "
                            "(the number of backward passes whose gradients accumulate before each step())")
        self.backward_passes_per_step = backward_passes_per_step
        self._passes = [0] * len(self._named)  # backward passes seen per parameter this step
        self._batch_size = 1
        self.engine = engine()
        if self.engine.ctx.distributed:  # the model on this worker's device (or the host), before any step
            check_tensors(self._named, self.engine.ctx.device, "DistributedOptimizer: parameter", model=True)
        self.sync = self.engine.ctx.comm.sync if self.engine.ctx.distributed else "sync"
        self.compression = self._check_compression(compression)
        self._async = None  # AsyncClient, made at the first step (after any checkpoint load)
        if overlap is None:  # the job's --overlap; all-reduce jobs overlap by default, as DDP does
            overlap = self.engine.ctx.comm.overlap or self.engine.ctx.comm.mode == "allreduce"
        self.overlap = bool(overlap) and self.sync == "sync"
        self._armed = False
        self._synced = False  # gradients of this step already exchanged (synchronize())
        self._skip = False
        self._hooks = []
        if self.overlap:
            index = {id(p): i for i, (_, p) in enumerate(self._named)}
            for _, p in self._named:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param, i=index[id(p)]: self._grad_ready(i, param)))

    def _check_compression(self, compression) -> str:
        """The job's codec, after checking that `compression` asks for that one (the
        summation servers decode with the job's codec, so a different one per optimizer
        cannot be honoured)."""
        ctx = self.engine.ctx
        job = ctx.comm.codec
        if compression is None:
            return job
        name = _codec_name(compression)
        if not ctx.distributed:  # one process: nothing crosses a wire
            return name
        if name != job:
            what = ("" if name == "fp32" else
                    " (codecs need summation servers: --mode byteps, ps or colocated)" if ctx.comm.mode == "allreduce"
                    else "")
            raise UserError(f"DistributedOptimizer(compression={compression!r}) asks for codec {name!r} but this job "
                            f"runs codec {job!r}: codecs are a job setting, since the summation servers decode with "
                            f"them; launch with `hetrain launch --codec {name}`{what}, or drop compression=")
        return name

    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Backward produced parameter i's gradient: start pushing it now (after the
        last of `backward_passes_per_step` backward passes)."""
        if not self._armed:
            return
        self._passes[i] += 1
        if self._passes[i] > self.backward_passes_per_step:
            raise UserError(f"parameter {self._named[i][0]!r} got {self._passes[i]} gradients in one step but "
                            f"backward_passes_per_step={self.backward_passes_per_step}: call step() after every "
                            f"{self.backward_passes_per_step} backward passes, or raise backward_passes_per_step")
        if self._passes[i] < self.backward_passes_per_step:
            return  # accumulate locally; the exchange happens on the last pass
        if not self.engine.in_flight:
            if not self.engine.begin(self._named, weight=self._batch_size, overlapped=True,
                                     total=getattr(self, "_total", None)):
                self._armed = False
                return
        if self.engine.is_ready(i):
            raise UserError(f"parameter {self._named[i][0]!r} got a second gradient in one step: overlap pushes each "
                            "gradient as soon as backward produces it; to accumulate gradients over several "
                            "backwards pass backward_passes_per_step=N (or drop --overlap)")
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

    def set_batch_size(self, batch_size: int, total: int | None = None) -> None:
        """This worker's batch this step; `total`: every worker's together, when known
        (BalancedLoader passes it), which spares an all-reduce job the step header."""
        self._batch_size = int(batch_size)
        self._total = None if total is None else int(total)
        self._size_set = True  # zero_grad() after this starts the step at once
        if self._armed and not self.engine.in_flight:
            # overlap: exchange the step header now, before backward, so the hooks only
            # send (waiting for the other workers must not count as this worker's compute,
            # or the balancer would read waiting as slowness)
            if not self.engine.begin(self._named, weight=self._batch_size, overlapped=True,
                                     total=getattr(self, "_total", None)):
                self._armed = False

    def synchronize(self) -> None:
        """Exchange the gradients now (Horovod's `synchronize`), e.g. to clip them before
        `with opt.skip_synchronize(): opt.step()`. step() does it unless it already happened
        this step."""
        if self.sync != "sync":
            raise UserError(f"synchronize() exchanges gradients synchronously but this job runs sync={self.sync!r}, "
                            "where step() pushes them to the parameter servers")
        _drain()
        named = []
        for n, p in self._named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            named.append((n, p.grad))
        self._armed = False
        if self.engine.in_flight:  # overlap: most partitions are already on their way
            self.engine.finish([t for _, t in named])
        else:
            self.engine.push_pull(named, weight=self._batch_size, total=getattr(self, "_total", None))
        self._passes = [0] * len(self._named)
        self._synced = True
        self._size_set = False
        self._total = None  # known for one step only

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
        self._passes = [0] * len(self._named)
        if self._armed and getattr(self, "_size_set", False) and not self.engine.in_flight:
            # the batch size is known (BalancedLoader sets it before the loop's zero_grad):
            # start the step header now, so it runs during forward
            self.set_batch_size(self._batch_size, getattr(self, "_total", None))
        self._size_set = False

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
        if _PENDING and not _ENGINE.ctx.failed:
            _drain()  # push_pull_async handles never synchronized: finish them like every other worker
        _HANDLES.clear()
        eng, _ENGINE = _ENGINE, None
        try:
            if not eng.ctx.failed:
                eng.shutdown()
        finally:
            _context.shutdown()
