"""Adasum: the adaptive summation of Maleki et al. ("Scaling Distributed Training with
Adaptive Summation", MLSys 2021), as Horovod's `op=hvd.Adasum`.

Two workers' vectors a and b combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal vectors add, equal vectors average, and anything in between falls in
between (a large effective learning rate without the divergence of a plain sum). More
workers combine pairwise up a binary tree in rank order, neighbours first (ranks 0+1,
2+3, then those pairs...), as Horovod's recursive halving does; with a worker count that
is not a power of two the odd one out is carried up a level unchanged. Each tensor is
combined on its own (per layer), as Horovod does.

Horovod runs the tree with vector halving and distance doubling over MPI or NCCL. Here
every worker gathers all workers' tensors (one all-gather on the job's transport) and
computes the same tree locally, in the same order, so every worker gets the same bits:
the same result as Horovod's algorithm with n times the traffic of an all-reduce, which
is fine for the sizes Adasum is used for on gloo but is not a bandwidth-optimal
implementation.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UserError
from .reduce_op import Carrier


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """adasum(a, b) of two flat vectors (dot products in float64; a zero vector adds nothing)."""
    a64, b64 = a.double(), b.double()
    dot = torch.dot(a64, b64)
    na, nb = torch.dot(a64, a64), torch.dot(b64, b64)
    ca = 1 - dot / (2 * na) if na > 0 else torch.ones((), dtype=torch.float64)
    cb = 1 - dot / (2 * nb) if nb > 0 else torch.ones((), dtype=torch.float64)
    return (ca * a64 + cb * b64).to(a.dtype)


def tree(vectors: list[torch.Tensor]) -> torch.Tensor:
    """Combine the workers' vectors (in rank order) pairwise up a binary tree."""
    level = list(vectors)
    while len(level) > 1:
        nxt = [combine(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def adasum_allreduce(t: torch.Tensor, what: str = "allreduce(op=Adasum)") -> torch.Tensor:
    """The Adasum of every worker's `t` (a new tensor, same shape, dtype and device)."""
    if not t.is_floating_point():
        raise UserError(f"{what}: Adasum combines floating-point tensors, got {t.dtype}; use op=hetrain.Sum")
    car = Carrier(t, what)
    n = dist.get_world_size(car.group) if car.ctx.distributed else 1
    if n == 1:
        return t.detach().clone()
    flat = car.buf.reshape(-1)
    work = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
    gathered = [torch.empty_like(work) for _ in range(n)]
    car.run(lambda: dist.all_gather(gathered, work, group=car.group))
    return car.back(tree(gathered).to(flat.dtype).view_as(car.buf))
