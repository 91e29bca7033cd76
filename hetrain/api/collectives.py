"""Horovod's tensor collectives (`hvd.allreduce`, `allgather`, `broadcast`, `alltoall`,
`reducescatter`, `barrier` and their in-place and asynchronous forms) on the workers.

Each runs on the job's transports as `reduce_op.Carrier` picks them: gloo among the
workers for host tensors; NCCL for CUDA tensors where every worker has a GPU of its
own, else through a host copy (gloo moves host memory only). Every worker must make the
same calls in the same order with tensors of the same shape (allgather and alltoall:
the same shape after the first dimension), as with Horovod. The results are new
tensors unless the name ends in `_`.

`process_set=` (Horovod's subsets of workers) is not taken: hetrain's collectives run
on all workers; pipeline-style subgroups push_pull through `hetrain.comm.PushPull(ctx,
group)`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UserError
from ..modes import CodecChoice
from . import uneven as _join
from .adasum import adasum_allreduce
from .basics import joined, size
from .compression import _codec_name
from .ops import Outstanding, _drain, new_handle
from .reduce_op import Carrier, ReduceOp, TORCH_OP, identity_like, resolve

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
           "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
           "alltoall_async", "reducescatter", "reducescatter_async", "grouped_allgather", "grouped_allgather_async",
           "grouped_reducescatter", "grouped_reducescatter_async", "barrier"]


class _Done(Outstanding):
    """A collective that already ran (hetrain has no background thread: the work happens
    at the call, the handle hands out the result)."""

    def __init__(self, result):
        self.result = result

    def poll(self) -> bool:
        return True

    def wait(self):
        return self.result


def _check_process_set(process_set, what: str) -> None:
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise UserError(f"{what}: process sets are not supported; hetrain's collectives run on all workers (use "
                        "hetrain.comm.PushPull(ctx, group) for a subgroup's push_pull)")


# what a collective sends for each codec it takes: the tensor's own dtype (None) or fp16
_WIRE_DTYPES = {CodecChoice.FP32: None, CodecChoice.FP16: torch.float16}


def _wire_dtype(t: torch.Tensor, compression, what: str) -> torch.dtype:
    """The dtype `t` travels in: Horovod's Compression.fp16 halves floating-point tensors."""
    if compression is None:
        return t.dtype
    name = _codec_name(compression)
    if name in _WIRE_DTYPES:
        wire = _WIRE_DTYPES[name]
        return wire if wire is not None and t.is_floating_point() else t.dtype
    raise UserError(f"{what}: compression={compression!r} is a summation-server codec; collectives take "
                    "Compression.none or Compression.fp16")


def _reduce_flat(flat: torch.Tensor, op: ReduceOp, active: int, what: str) -> torch.Tensor:
    """All-reduce one flat tensor among the workers (Average over the `active` ones).
    `flat` is a buffer made for this call: it may be reduced, and divided, in place."""
    if op == ReduceOp.ADASUM:
        return adasum_allreduce(flat, what)
    if op == ReduceOp.AVERAGE and not (flat.is_floating_point() or flat.is_complex()):
        raise UserError(f"{what}: the average of a {flat.dtype} tensor is not an integer; use op=hetrain.Sum, or "
                        "a floating-point tensor")
    car = Carrier(flat, what, owned=True)
    if car.ctx.distributed and car.ctx.num_workers > 1:
        car.run(lambda: dist.all_reduce(car.buf, op=TORCH_OP[op], group=car.group))
    out = car.back(car.buf)
    if op == ReduceOp.AVERAGE:
        out = out.div_(active)
    return out


def _allreduce_many(tensors: list[torch.Tensor], op: ReduceOp, prescale: float, postscale: float, compression,
                    what: str) -> list[torch.Tensor]:
    """Reduce several tensors: those of one dtype and device travel fused in one buffer
    (Adasum: one by one, since it combines per tensor)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise UserError(f"{what}: expected torch.Tensors, got {type(t).__name__}")
    _drain()
    results: list[torch.Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype) if op != ReduceOp.ADASUM else (i,)
        buckets.setdefault(key, []).append(i)
    for idx in buckets.values():
        parts = [tensors[i].detach() for i in idx]
        wire = _wire_dtype(parts[0], compression, what)
        flat = torch.cat([p.reshape(-1) for p in parts]).to(wire)
        if prescale != 1.0:
            flat = flat * prescale
        active = _join.announce(_join.Kind.ALLREDUCE, list(ReduceOp).index(op), _join.dtype_index(flat.dtype),
                                flat.numel())
        out = _reduce_flat(flat, op, active, what)
        if postscale != 1.0:
            out = out * postscale
        off = 0
        for i, p in zip(idx, parts):
            results[i] = out[off: off + p.numel()].view(p.shape).to(p.dtype)
            off += p.numel()
    return results


def _shadow_allreduce(args: list[int], active: int) -> None:
    """A joined worker's part in another worker's allreduce: the identity of the op."""
    op, dtype, numel = list(ReduceOp)[args[0]], _join.dtype_of(args[1]), args[2]
    mine = identity_like(torch.empty(numel, dtype=dtype), op)
    _reduce_flat(mine, op, max(active, 1), "allreduce (joined worker)")


_join._SHADOWS[_join.Kind.ALLREDUCE] = _shadow_allreduce


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None) -> torch.Tensor:
    """The reduction of `tensor` over the workers (default the average), a new tensor.
    `prescale_factor`/`postscale_factor` multiply before and after the reduction;
    `compression=Compression.fp16` sends floating-point tensors as float16. After a
    worker has called `join()`, Average is over the workers that have not."""
    _check_process_set(process_set, "allreduce")
    op = resolve(op, average, "allreduce")
    return _allreduce_many([tensor], op, prescale_factor, postscale_factor, compression, "allreduce")[0]


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=None) -> torch.Tensor:
    """`allreduce` in place: `tensor` holds the result, and is returned."""
    with torch.no_grad():
        tensor.copy_(allreduce(tensor, average, name, None, op, prescale_factor, postscale_factor, process_set))
    return tensor


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=None) -> int:
    """`allreduce` with a handle for `hetrain.synchronize(handle)` / `poll(handle)`."""
    return new_handle(_Done(allreduce(tensor, average, name, None, op, prescale_factor, postscale_factor,
                                      process_set)))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=None) -> int:
    """`allreduce_` with a handle; synchronize returns `tensor`."""
    return new_handle(_Done(allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)))


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None) -> list[torch.Tensor]:
    """`allreduce` of a list of tensors in one operation (fused per dtype); new tensors."""
    _check_process_set(process_set, "grouped_allreduce")
    op = resolve(op, average, "grouped_allreduce")
    return _allreduce_many(list(tensors), op, prescale_factor, postscale_factor, compression, "grouped_allreduce")


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=None) -> list[torch.Tensor]:
    """`grouped_allreduce` in place; returns the tensors."""
    tensors = list(tensors)
    out = grouped_allreduce(tensors, average, name, None, op, prescale_factor, postscale_factor, process_set)
    with torch.no_grad():
        for t, r in zip(tensors, out):
            t.copy_(r)
    return tensors


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=None) -> int:
    return new_handle(_Done(grouped_allreduce(tensors, average, name, None, op, prescale_factor, postscale_factor,
                                              process_set)))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=None) -> int:
    return new_handle(_Done(grouped_allreduce_(tensors, average, name, op, prescale_factor, postscale_factor,
                                               process_set)))


def _gather_sizes(car: Carrier, n: int, values: list[int]) -> list[list[int]]:
    """Every worker's list of small integers (same length everywhere), in rank order."""
    mine = torch.tensor(values, dtype=torch.int64)
    got = [torch.empty_like(mine) for _ in range(n)]
    car.run(lambda: dist.all_gather(got, mine, group=car.ctx.worker_group))
    return [g.tolist() for g in got]


def allgather(tensor, name=None, process_set=None) -> torch.Tensor:
    """Every worker's `tensor` concatenated along the first dimension, in rank order (the
    first dimension may differ between workers, the others must not)."""
    _check_process_set(process_set, "allgather")
    _drain()
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise UserError("allgather: expected a torch.Tensor with at least one dimension")
    car = Carrier(tensor, "allgather")
    if not car.ctx.distributed or car.ctx.num_workers == 1:
        return tensor.detach().clone()
    _join.refuse_if_joined("allgather")
    n = car.ctx.num_workers
    shapes = _gather_sizes(car, n, [tensor.dim()])
    if len({s[0] for s in shapes}) != 1:
        raise UserError(f"allgather: the workers' tensors have different numbers of dimensions "
                        f"({[s[0] for s in shapes]} in rank order)")
    shapes = _gather_sizes(car, n, list(tensor.shape))
    if len({tuple(s[1:]) for s in shapes}) != 1:
        raise UserError(f"allgather: the workers' tensors differ after the first dimension (shapes {shapes} in rank "
                        "order); only the first dimension may differ")
    rows = [s[0] for s in shapes]
    top = max(rows)
    pad = torch.zeros((top, *tensor.shape[1:]), dtype=car.buf.dtype, device=car.buf.device)
    pad[: tensor.shape[0]] = car.buf
    got = [torch.empty_like(pad) for _ in range(n)]
    car.run(lambda: dist.all_gather(got, pad, group=car.group))
    return car.back(torch.cat([g[:r] for g, r in zip(got, rows)]))


def allgather_async(tensor, name=None, process_set=None) -> int:
    return new_handle(_Done(allgather(tensor, name, process_set)))


def broadcast(tensor, root_rank: int, name=None, process_set=None) -> torch.Tensor:
    """Root's `tensor` on every worker (a new tensor; the others' values are ignored,
    their shapes and dtypes must match root's)."""
    _check_process_set(process_set, "broadcast")
    _drain()
    n = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise UserError(f"broadcast: root_rank={root_rank!r} is not a worker rank; use 0..{n - 1}")
    car = Carrier(tensor, "broadcast")
    if not car.ctx.distributed or n == 1:
        return tensor.detach().clone()
    _join.refuse_if_joined("broadcast")
    car.run(lambda: dist.broadcast(car.buf, src=root_rank, group=car.group), [root_rank])
    return car.back(car.buf)


def broadcast_(tensor, root_rank: int, name=None, process_set=None) -> torch.Tensor:
    """`broadcast` in place; returns `tensor`."""
    with torch.no_grad():
        tensor.copy_(broadcast(tensor, root_rank, name, process_set))
    return tensor


def broadcast_async(tensor, root_rank: int, name=None, process_set=None) -> int:
    return new_handle(_Done(broadcast(tensor, root_rank, name, process_set)))


def broadcast_async_(tensor, root_rank: int, name=None, process_set=None) -> int:
    return new_handle(_Done(broadcast_(tensor, root_rank, name, process_set)))


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Scatter slices of `tensor`'s first dimension to the workers and gather theirs:
    worker j gets rows splits[j] of every worker (default: equal parts), in rank order.
    Returns the gathered tensor, and with `splits` given also the rows received from
    each worker (as Horovod)."""
    _check_process_set(process_set, "alltoall")
    _drain()
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise UserError("alltoall: expected a torch.Tensor with at least one dimension")
    n = size()
    rows = tensor.shape[0]
    given = splits is not None
    if splits is None:
        if rows % n:
            raise UserError(f"alltoall: {rows} rows cannot be split equally over {n} workers; pass splits=")
        splits = [rows // n] * n
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise UserError(f"alltoall: splits={splits} must be {n} non-negative row counts adding up to {rows}")
    car = Carrier(tensor, "alltoall")
    if not car.ctx.distributed or n == 1:
        out = tensor.detach().clone()
        return (out, torch.tensor(splits, dtype=torch.int32)) if given else out
    _join.refuse_if_joined("alltoall")
    send = torch.tensor(splits, dtype=torch.int64)
    recv = torch.empty_like(send)
    car.run(lambda: dist.all_to_all_single(recv, send, group=car.ctx.worker_group))
    per_row = int(torch.Size(tensor.shape[1:]).numel())
    got = recv.tolist()
    out = torch.empty((sum(got), *tensor.shape[1:]), dtype=car.buf.dtype, device=car.buf.device)
    car.run(lambda: dist.all_to_all_single(out.view(-1), car.buf.reshape(-1), [g * per_row for g in got],
                                           [s * per_row for s in splits], group=car.group))
    out = car.back(out)
    return (out, recv.to(torch.int32)) if given else out


def reducescatter(tensor, op=None, name=None, compression=None, process_set=None, prescale_factor=1.0,
                  postscale_factor=1.0) -> torch.Tensor:
    """The reduction (default the average) of `tensor` over the workers, of which this
    worker keeps its slice of the first dimension: rows split as evenly as possible,
    the first workers taking one more (as Horovod). Implemented as an all-reduce and a
    slice, since gloo has no reduce-scatter with uneven parts."""
    _check_process_set(process_set, "reducescatter")
    op = resolve(op, None, "reducescatter")
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise UserError(f"reducescatter: op={op!r}; reducescatter takes hetrain.Average or hetrain.Sum")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise UserError("reducescatter: expected a torch.Tensor with at least one dimension")
    ctx = joined()
    if ctx.distributed and ctx.num_workers > 1:
        _join.refuse_if_joined("reducescatter")
    full = _allreduce_many([tensor], op, prescale_factor, postscale_factor, compression, "reducescatter")[0]
    n, me = size(), ctx.rank if ctx.distributed else 0
    base, extra = divmod(tensor.shape[0], n)
    lo = me * base + min(me, extra)
    return full[lo: lo + base + (1 if me < extra else 0)].clone()


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    return new_handle(_Done(alltoall(tensor, splits, name, process_set)))


def reducescatter_async(tensor, op=None, name=None, compression=None, process_set=None, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    return new_handle(_Done(reducescatter(tensor, op, name, compression, process_set, prescale_factor,
                                          postscale_factor)))


def grouped_allgather(tensors, name=None, process_set=None) -> list[torch.Tensor]:
    """`allgather` of each tensor of a list."""
    return [allgather(t, name, process_set) for t in tensors]


def grouped_allgather_async(tensors, name=None, process_set=None) -> int:
    return new_handle(_Done(grouped_allgather(tensors, name, process_set)))


def grouped_reducescatter(tensors, op=None, name=None, compression=None, process_set=None, prescale_factor=1.0,
                          postscale_factor=1.0) -> list[torch.Tensor]:
    """`reducescatter` of each tensor of a list."""
    return [reducescatter(t, op, name, compression, process_set, prescale_factor, postscale_factor) for t in tensors]


def grouped_reducescatter_async(tensors, op=None, name=None, compression=None, process_set=None,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    return new_handle(_Done(grouped_reducescatter(tensors, op, name, compression, process_set, prescale_factor,
                                                  postscale_factor)))


def barrier(process_set=None) -> None:
    """Wait until every worker (that has not joined) gets here."""
    _check_process_set(process_set, "barrier")
    _drain()
    ctx = joined()
    if not ctx.distributed or ctx.num_workers == 1:
        return
    _join.announce(_join.Kind.BARRIER)
    try:
        dist.barrier(group=ctx.worker_group)
    except RuntimeError as err:
        raise ctx.peer_error("barrier", [], err) from None
