"""Whether a transport's members can use shared memory, and building their host group;
and the point-to-point channels of a worker and its summation servers (`channels_for`).

Shared memory is used where every member runs on this host as the launcher lays the job
out (runtime/shmnames.py `same_host`: the machines of one node, unless links between
machines are emulated, where each machine stands for a host of its own) and the job has
a secret (hetrain's launcher; plain torchrun has none, and keeps gloo). The decision
depends on the topology alone, so every member takes the same one.
"""
from __future__ import annotations

import itertools
import os
import sys
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist

from ...errors import UserError
from ...runtime.auth import load_secret
from ...runtime.shmnames import SHM_DIR, same_host
from ..p2p import Channel, GlooChannel
from .arena import ArenaGroup, arena_bytes
from .group import DEFAULT_CAPACITY, HostGroup

MIN_CAPACITY = 1 << 20
_MADE: defaultdict = defaultdict(itertools.count)  # per group name: engines built on it, in order


def usable(ctx, members) -> bool:
    """Every member on this host, two or more of them, a hetrain-launched job on Linux."""
    env = getattr(ctx, "env", None)
    return (members.size >= 2 and members.member and env is not None and env.origin == "hetrain"
            and sys.platform.startswith("linux") and SHM_DIR.is_dir()
            and same_host(ctx.topology, ctx.cluster, members.ranks))


def _room(members) -> int:
    """Bytes of /dev/shm one member may take: half its free space shared by the members
    (the other half stays for whatever else the host keeps there)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize // (2 * members.size)


def _agreed_min(value: int, members) -> int:
    """The members' minimum of `value`, over gloo (control only)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=members.gloo)
    return int(t.item())


def _capacity(members) -> int:
    """Bytes per member's segment: the default, less where /dev/shm is small (a container's
    64 MiB default), the same on every member (their minimum); under `MIN_CAPACITY` where
    /dev/shm has no room at all."""
    return _agreed_min(min(DEFAULT_CAPACITY, _room(members)) // MIN_CAPACITY * MIN_CAPACITY, members)


def _kw(ctx, members, key: str, capacity: int) -> dict:
    def barrier() -> None:  # control only: the segments exist / are mapped
        dist.barrier(group=members.gloo)

    return dict(job_id=ctx.env.job_id, secret=load_secret(), key=key, ranks=members.ranks, rank=ctx.rank,
                barrier=barrier, capacity=capacity, timeout_s=ctx.comm.op_timeout_s)


def build_arena(ctx, members, lengths: list[int], host: bool) -> ArenaGroup | None:
    """Segments holding fp32 buckets of `lengths` elements, one per member (comm/shm/arena.py),
    where every member's tensors are on the host (`host`) and /dev/shm has room for them on
    every member; else None (every member learns the same, and the buckets go through the
    rounds of `build`'s group)."""
    need = arena_bytes(lengths)
    if not _agreed_min(int(host and need <= _room(members)), members):
        return None
    key = f"r{ctx.env.restart}-{members.name}-arena{next(_MADE[members.name + '-arena'])}"
    try:
        return ArenaGroup(**_kw(ctx, members, key, need))
    except RuntimeError as err:  # a member died while the segments were made
        raise ctx.peer_error("setting up the shared-memory buckets", [r for r in members.ranks if r != ctx.rank],
                             err) from None


def build(ctx, members, cuda: bool) -> HostGroup | None:
    """The host group of this engine's members (called by every member at its first step).
    None where /dev/shm has no room for it (every member learns the same): host buffers
    then keep gloo; CUDA buffers, which gloo cannot take, need the room."""
    key = f"r{ctx.env.restart}-{members.name}{next(_MADE[members.name])}"
    capacity = _capacity(members)
    if capacity < MIN_CAPACITY:
        if not cuda:
            warnings.warn(f"{SHM_DIR} has no room for the shared-memory all-reduce of {members.size} processes; "
                          "gloo carries it (give the container more: docker run --shm-size=1g)", RuntimeWarning)
            return None
        raise UserError(f"{SHM_DIR} has too little free space for the shared-memory all-reduce of {members.size} "
                        "processes with CUDA tensors; free some, or give the container more (docker run --shm-size=1g)")
    kw = _kw(ctx, members, key, capacity)
    try:
        if cuda:
            from .cuda import CudaHostGroup

            return CudaHostGroup(device=ctx.device, **kw)
        return HostGroup(**kw)
    except RuntimeError as err:  # a member died while the segments were made
        raise ctx.peer_error("setting up the shared-memory all-reduce", [r for r in members.ranks if r != ctx.rank],
                             err) from None


# ---- a worker and its summation servers -----------------------------------------------
_PUMPS: dict[tuple, object] = {}  # per (job, round, rank): this process's mailbox and its threads
_CHANNELS: dict[tuple, dict] = {}  # per (job, round, rank, peers): the channels chosen


def _hosts_shm(ctx) -> bool:
    env = getattr(ctx, "env", None)
    return (env is not None and env.origin == "hetrain" and ctx.topology is not None and ctx.comm.server_shm
            and sys.platform.startswith("linux") and SHM_DIR.is_dir())


def partners(ctx) -> list[int]:
    """The ranks this process exchanges partitions with over shared memory: for a worker
    the summation servers on its host, for a server the workers on its host (host as the
    launcher lays the job out, `same_host`). Empty where shared memory is not used
    (`--server-link gloo`, a job hetrain did not launch, no /dev/shm)."""
    if not _hosts_shm(ctx):
        return []
    topo = ctx.topology
    others = [p.rank for p in topo.servers] if ctx.is_worker else topo.worker_ranks
    return [r for r in others if r != ctx.rank and same_host(topo, ctx.cluster, [ctx.rank, r])]


def channels_for(ctx, peers: list[int]) -> dict[int, Channel]:
    """One channel per peer in `peers`: shared memory for a partner on this host
    (comm/shm/channel.py; this process's mailbox is made at the first call), gloo for
    the others. Both ends decide from the same topology, so they agree."""
    env = getattr(ctx, "env", None)
    key = (env.job_id, env.restart, ctx.rank, tuple(peers)) if env is not None else None
    if key in _CHANNELS:  # the server leg is made at every step: decide once
        return _CHANNELS[key]
    local = set(partners(ctx))
    out: dict[int, Channel] = {p: GlooChannel(p) for p in peers if p not in local}
    if local & set(peers):
        pump = _pump(ctx, sorted(local))
        out.update({p: pump.channels[p] for p in peers if p in local})
    if key is not None:
        _CHANNELS[key] = out
    return out


def _pump(ctx, local: list[int]):
    from .mailbox import DIRECTORY, SLOT_BYTES, SLOTS, ring_bytes
    from .pump import Pump

    key = (ctx.env.job_id, ctx.env.restart, ctx.rank)
    if key not in _PUMPS:
        # tmpfs makes a file of any size and kills the process that touches a page it has
        # no room for (SIGBUS): refuse up front, saying what to do
        need, st = DIRECTORY + len(local) * ring_bytes(SLOTS, SLOT_BYTES), os.statvfs(SHM_DIR)
        if need > st.f_bavail * st.f_frsize // 2:
            raise UserError(f"{SHM_DIR} has {st.f_bavail * st.f_frsize >> 20} MiB free; the shared-memory mailbox of "
                            f"{ctx.describe(ctx.rank)} for the {len(local)} peer(s) on its host needs {need >> 20} MiB "
                            "and leaves half the space to others: give the container more (docker run "
                            "--shm-size=1g), or move partitions over gloo with `hetrain launch --server-link gloo`")
        def lost() -> list[int]:
            return list(ctx.lost_peers(wait_s=0.0))

        _PUMPS[key] = Pump(ctx.env.job_id, load_secret(), f"r{ctx.env.restart}-p2p", ctx.rank, local,
                           timeout_s=ctx.comm.op_timeout_s, lost=lost)
    return _PUMPS[key]
