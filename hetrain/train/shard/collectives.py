"""The collectives of sharded data parallelism on torch.distributed, written for gloo too.

gloo has no reduce-scatter and no uneven all-gather, so both are built from the
primitives it has, each writing in place into a slice of one flat buffer (no padding,
no extra copy):

- reduce to owners: one `dist.reduce` per owner of its span (the owner ends with the
  sum of that span; the other workers' slices are scratch);
- gather from owners: one `dist.broadcast` per owner of its span into the full buffer.

All return the asynchronous works so the caller can overlap them with compute (the
next unit's forward, the rest of backward) and wait only where the data is needed.
A CUDA buffer on a gloo group (a GPU worker beside CPU workers) goes through a host copy,
synchronously: gloo's reduce takes host tensors only.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def global_ranks(group, n: int) -> list[int]:
    """The global rank of each of the group's `n` members (the group None: the default one)."""
    if group is None:
        return list(range(n))
    return [dist.get_global_rank(group, i) for i in range(n)]


def _host_staged(flat: torch.Tensor, group) -> bool:
    return flat.device.type != "cpu" and dist.get_backend(group) == "gloo"


def _staged(flat: torch.Tensor, run) -> list:
    """Run the collectives `run` makes on a host copy of `flat`, then copy back."""
    host = flat.detach().to("cpu")
    wait(run(host))
    flat.copy_(host)
    return []


def _per_owner(flat: torch.Tensor, spans: Sequence[tuple[int, int]], ranks: Sequence[int], group, start) -> list:
    """`start(piece, owner)` for each owner's non-empty span of `flat` (a host copy first
    where gloo carries a CUDA buffer); the works, to wait on."""
    if len(ranks) == 1:  # a one-worker job: nothing to exchange
        return []
    if _host_staged(flat, group):
        return _staged(flat, lambda h: _per_owner(h, spans, ranks, group, start))
    return [start(flat[s:e], owner) for (s, e), owner in zip(spans, ranks) if e > s]


def reduce_to_owners(flat: torch.Tensor, spans: Sequence[tuple[int, int]], ranks: Sequence[int],
                     group=None) -> list:
    """Sum `flat` over the workers, each span landing on its owner (in place)."""
    return _per_owner(flat, spans, ranks, group, lambda piece, owner: dist.reduce(
        piece, dst=owner, op=dist.ReduceOp.SUM, group=group, async_op=True))


def gather_from_owners(flat: torch.Tensor, spans: Sequence[tuple[int, int]], ranks: Sequence[int],
                       group=None) -> list:
    """Fill `flat` with every owner's span (the caller has put its own span in place)."""
    return _per_owner(flat, spans, ranks, group, lambda piece, owner: dist.broadcast(
        piece, src=owner, group=group, async_op=True))


def broadcast_from(flat: torch.Tensor, src: int, group=None) -> None:
    """All of `flat` from global rank `src` (the job's starting values)."""
    if _host_staged(flat, group):
        _staged(flat, lambda h: [dist.broadcast(h, src=src, group=group, async_op=True)])
    else:
        dist.broadcast(flat, src=src, group=group)


def gather_by_sum(flat: torch.Tensor, own: tuple[int, int], group=None) -> list:
    """Fill `flat` with every owner's span in one all-reduce: each worker zeroes all but
    its own span and the spans add up (x + 0 + ... + 0 = x, exactly). One collective a
    unit instead of one per owner: on gloo the number of collectives, not the bytes,
    bounds a step of many small units (bench/shard.py), and it needs no buffer beside
    `flat` (an uneven all-gather would: gloo's needs equal, padded pieces)."""
    s, e = own
    with torch.no_grad():
        flat[:s].zero_()
        flat[e:].zero_()
    return all_reduce(flat, group)


def all_reduce(flat: torch.Tensor, group=None) -> list:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return []
    if _host_staged(flat, group):
        return _staged(flat, lambda h: all_reduce(h, group))
    return [dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)]


def wait(works: list) -> None:
    for w in works:
        w.wait()
    works.clear()
