"""The workers one push_pull engine serves: the whole job's workers, or a subgroup.

A pipeline stage's replicas average their dense gradients among themselves only; the
other stages and the sparse-PS shards of the same job never join. Such an engine is
built on a `Group`: its members' global ranks (in group order: group index i is global
rank ``ranks[i]``), a gloo process group for host collectives (the step header, the
manifests, host tensors) and, where every member is a CUDA GPU of its own, an NCCL
process group for CUDA tensors. The backend is decided once per group, identically on
every rank, from the cluster file and the flags (`runtime.devices.group_backend`).

torch.distributed requires every rank to create every process group, in the same
order, member or not; `make_groups` is therefore called by every rank with the same
rank lists and returns a `Group` for each (holding process groups only where this rank
is a member). A subgroup engine always all-reduces: summation servers sum for the whole
job's workers, and a stage's few replicas gain nothing from a server hop.

`exchange_group` is the other kind: the workers of one training step's gradient exchange
when some sit out (a balanced job, hetrain.api.members). Those sets are only known while
training runs, and on the workers alone: every worker makes each set's group at the step
that first uses it; the summation servers never do.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from ..errors import UserError
from ..runtime.commthreads import yield_loop_threads
from ..runtime.devices import group_backend, nccl_environment, nccl_group_options


@dataclass(frozen=True)
class Group:
    """Members of one engine. `gloo` / `nccl` are None where this rank is not a member
    (and `nccl` where the group's CUDA collectives go through gloo from pinned buffers)."""

    name: str
    ranks: tuple[int, ...]
    gloo: object | None = None
    nccl: object | None = None
    member: bool = True
    whole_job: bool = False  # every worker of the job (the group of a plain PushPull)
    # an engine on this group may keep its buckets in memory of its own, the size of the
    # gradients (shared segments: comm/shm/arena.py); not an exchange set's, one of several
    # engines a worker switches between, each of which would hold a copy
    keeps_buckets: bool = True

    def __post_init__(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise UserError(f"group {self.name!r} needs distinct member ranks, got {list(self.ranks)}")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        """The job rank of the group's index-th member (all-gathers come in group order)."""
        return self.ranks[index]

    def describe(self) -> str:
        return f"{self.name} (ranks {', '.join(map(str, self.ranks))})"


def job_group(ctx) -> Group:
    """Every worker of the job: the group a plain `PushPull(ctx)` all-reduces over."""
    ranks = tuple(ctx.topology.worker_ranks) if ctx.topology else (0,)
    return Group("workers", ranks, ctx.worker_group, ctx.nccl_group, whole_job=True)


def make_groups(ctx, rank_lists: Sequence[Sequence[int]], names: Sequence[str]) -> list[Group]:
    """One `Group` per rank list (every rank calls this with the same lists, in the same
    order). In a one-process job every group is that process alone, with no process
    groups: an engine on it only applies the batch weighting."""
    if len(rank_lists) != len(names):
        raise UserError(f"make_groups: {len(rank_lists)} rank lists but {len(names)} names")
    out = []
    for ranks, name in zip(rank_lists, names):
        ranks = tuple(int(r) for r in ranks)
        if not ctx.distributed:
            out.append(Group(name, ranks, member=ctx.rank in ranks))
            continue
        bad = [r for r in ranks if not 0 <= r < ctx.world_size]
        if bad:
            raise UserError(f"group {name!r} names rank(s) {bad}, but the job has ranks 0..{ctx.world_size - 1}")
        not_workers = [r for r in ranks if ctx.topology.proc(r).role != "worker"]
        if not_workers:
            raise UserError(f"group {name!r} names rank(s) {not_workers}, which are summation servers; a group's "
                            "members must be workers")
        backend = group_backend(ctx.topology, ranks, ctx.comm)
        wait = timedelta(seconds=ctx.comm.timeout_s)
        gloo = dist.new_group(list(ranks), timeout=wait)
        nccl = None
        if backend == "nccl":
            nccl_environment()
            nccl = dist.new_group(list(ranks), timeout=wait, backend="nccl", **nccl_group_options(ctx.device))
        member = ctx.rank in ranks
        out.append(Group(name, ranks, gloo if member else None, nccl if member else None, member))
    yield_loop_threads()  # the new groups' gloo threads yield as init()'s do (runtime/commthreads.py)
    return out


def exchange_group(ctx, ranks: Sequence[int]) -> Group:
    """The `Group` of the workers `ranks` (job ranks) exchanging gradients among
    themselves while the job's other workers sit out. Every worker of the job calls it,
    member or not, at the same step (the first that uses this set): torch.distributed names
    a group by how many each process has made, so the workers' counts must stay equal.
    The summation servers take no part: a group is made without a barrier, and a process
    that is not a member returns at once. One worker alone needs no process group (its
    engine only weights)."""
    ranks = tuple(sorted(int(r) for r in ranks))
    name = "exchange " + ",".join(map(str, ranks))
    member = ctx.rank in ranks
    if not ctx.distributed or len(ranks) == 1:
        return Group(name, ranks, member=member, keeps_buckets=False)
    wait = timedelta(seconds=ctx.comm.timeout_s)
    gloo = dist.new_group(list(ranks), timeout=wait, backend="gloo")
    nccl = None
    if group_backend(ctx.topology, ranks, ctx.comm) == "nccl":
        if member:
            nccl_environment()
            nccl = dist.new_group(list(ranks), timeout=wait, backend="nccl", **nccl_group_options(ctx.device))
        else:  # counted the same; a process outside the group makes nothing (nor needs NCCL)
            dist.new_group(list(ranks), timeout=wait, backend="gloo")
    yield_loop_threads()
    return Group(name, ranks, gloo if member else None, nccl, member, keeps_buckets=False)
