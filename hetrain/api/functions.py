"""Broadcasts of parameters, optimizer state and objects (Horovod's `functions`):
root's values to every worker, each tensor in its own dtype; objects without pickle."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import p2p
from ..errors import UserError
from .basics import _check_root, joined

def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Copy root's parameters (a state_dict, named_parameters() or list of tensors) to all
    workers, tensor by tensor, each in its own dtype and on its own device (its raw bytes
    travel, so every dtype arrives exact and nothing is converted). CUDA tensors go over
    NCCL where the workers have it, else through a host copy (gloo takes host memory
    only)."""
    ctx = joined()
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
    ctx = joined()
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
    from .. import objects

    ctx = joined()
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
    ctx = joined()
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


def allgather_object(obj, name: str | None = None) -> list:
    """Every worker's `obj`, as a list in rank order (Horovod's `allgather_object`).

    Nothing is pickled: objects are encoded as `broadcast_object` encodes them (tensors,
    numbers, strings, bytes, None and containers of them); an object a worker cannot
    send is refused with a UserError on every worker, naming that worker."""
    from .. import objects

    ctx = joined()
    data, error = b"", None
    try:
        data = objects.encode(obj)
    except UserError as err:
        error = str(err)
    if not ctx.distributed or ctx.num_workers == 1:
        if error is not None:
            raise UserError(error)
        return [obj]
    payload = error.encode() if error is not None else data
    n = ctx.num_workers
    head = torch.tensor([len(payload), int(error is not None)], dtype=torch.int64)
    heads = [torch.empty_like(head) for _ in range(n)]
    top = 0
    try:
        dist.all_gather(heads, head, group=ctx.worker_group)
        top = max(int(h[0]) for h in heads)
        buf = torch.zeros(max(top, 1), dtype=torch.uint8)
        if payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        got = [torch.empty_like(buf) for _ in range(n)]
        dist.all_gather(got, buf, group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error("gathering objects", [], err) from None
    raw = [bytes(g[: int(h[0])].numpy().tobytes()) for g, h in zip(got, heads)]
    for r, (h, b) in enumerate(zip(heads, raw)):
        if int(h[1]):
            raise UserError(f"{b.decode(errors='replace')} (refused on rank {r}, in allgather_object)")
    return [obj if r == ctx.rank else objects.decode(b) for r, b in enumerate(raw)]
