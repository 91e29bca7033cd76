"""Reduction operations of the collectives (Horovod's `hvd.Average`, `hvd.Sum`,
`hvd.Adasum`, `hvd.Min`, `hvd.Max`, `hvd.Product`) and the carrier that moves a tensor
over the job's transports: gloo among the workers for host tensors; for a CUDA tensor,
NCCL where every worker has a GPU of its own, else a host copy through gloo (gloo
moves host memory only, so a CUDA tensor is never handed to it)."""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from ..comm import p2p
from ..errors import UserError
from .basics import joined


class ReduceOp(enum.Enum):
    """How `allreduce` combines the workers' tensors."""

    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"

    def __repr__(self) -> str:
        return f"hetrain.{self.name.title()}"


Average, Sum, Adasum = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT

TORCH_OP = {ReduceOp.AVERAGE: dist.ReduceOp.SUM, ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}
# What a worker that has joined (hetrain.join) contributes, so that it changes nothing
IDENTITY = {ReduceOp.AVERAGE: 0, ReduceOp.SUM: 0, ReduceOp.ADASUM: 0, ReduceOp.MIN: float("inf"),
            ReduceOp.MAX: float("-inf"), ReduceOp.PRODUCT: 1}
_BY_NAME = {op.value: op for op in ReduceOp}


def resolve(op, average, what: str) -> ReduceOp:
    """The operation asked for by Horovod's `op=` or its older `average=` (not both)."""
    if op is not None and average is not None:
        raise UserError(f"{what}: pass op= or average=, not both (average= is Horovod's older spelling of "
                        "op=hetrain.Average / hetrain.Sum)")
    if op is None:
        return ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    if isinstance(op, ReduceOp):
        return op
    found = _BY_NAME.get(str(op).lower()) if isinstance(op, str) else None
    if found is None:
        raise UserError(f"{what}: op={op!r} is not a reduction hetrain knows; use hetrain.Average, Sum, Adasum, "
                        "Min, Max or Product")
    return found


def identity_like(t: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """A tensor like `t` that leaves the reduction unchanged (what a joined worker sends)."""
    value = IDENTITY[op]
    if not (t.is_floating_point() or t.is_complex()) and value in (float("inf"), float("-inf")):
        info = torch.iinfo(t.dtype) if t.dtype != torch.bool else None
        value = (True if value > 0 else False) if info is None else (info.max if value > 0 else info.min)
    return torch.full_like(t, value)


class Carrier:
    """One tensor on its way through a collective: `buf` is what the process group moves
    (the tensor itself, or a host copy in a dtype gloo takes), `group` the group that
    moves it; `back(result)` writes a result into the caller's device and dtype."""

    def __init__(self, t: torch.Tensor, what: str, owned: bool = False):
        if not isinstance(t, torch.Tensor):
            raise UserError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type not in ("cpu", "cuda"):
            raise UserError(f"{what}: the tensor is on {t.device}, which holds no data to send; move it to the CPU "
                            "or its GPU first")
        self.ctx = joined()
        self.what = what
        self.device, self.dtype = t.device, t.dtype
        nccl = t.device.type == "cuda" and self.ctx.nccl_group is not None
        self.group = self.ctx.nccl_group if nccl else self.ctx.worker_group
        data = t.detach()
        if not nccl:  # gloo: host memory, and bool travels as bytes
            data = data.to("cpu", torch.uint8 if t.dtype == torch.bool else t.dtype)
            p2p.host_only(data, what)
        # the caller's own memory is copied before a collective writes into it, unless the
        # caller says `t` is a buffer of its own (`owned`: a fused copy made for this call)
        shared = not owned and (data is t or data.data_ptr() == t.data_ptr())
        self.buf = data.contiguous().clone() if shared else data.contiguous()

    def back(self, result: torch.Tensor) -> torch.Tensor:
        return result.to(self.device, self.dtype)

    def run(self, call, peers=()) -> None:
        """Run `call()` (a torch.distributed collective), naming the lost peer if one fails."""
        try:
            call()
        except RuntimeError as err:
            raise self.ctx.peer_error(self.what, list(peers), err) from None
