"""How the all-reduce transport moves one bucket, chosen once when the transport is
built (`collective_for`), by type:

- `ProcessGroupCollective`: torch.distributed over the members' process groups: NCCL for
  device buffers where every member is a GPU of its own, gloo for host buffers (two
  members swap small buckets instead: `p2p.Swap`, one round, not gloo's two);
- `ShmCollective`: every member on one host: a reduce-scatter and an all-gather over
  shared segments (comm/shm/), no socket. Where every member's tensors are on the host,
  the transport owns the staging's memory: the buckets are allocated in the segments
  (`arena_for`, comm/shm/arena.py) and summed where backward wrote them. Where this
  worker's tensors are CUDA ones the segments are pinned and its buckets stay on the GPU
  until the copy into the segment (comm/shm/cuda.py).

The hierarchical transport's in-host reduce and broadcast take shared memory the same
way (`local_shm`) where the machine's workers exchange host buffers: on a work buffer
allocated in the arena, or in the host group's rounds.
"""
from __future__ import annotations

import torch.distributed as dist

from .. import p2p
from ..cargo import CARGO_ROOM


class ProcessGroupCollective:
    """gloo / NCCL, as torch.distributed runs them (see the module docstring)."""

    SWAP_BUCKET_BYTES = 1 << 20
    SWAP_SCRATCH_BYTES = 8 << 20

    def __init__(self, ctx, members):
        self.ctx = ctx
        self.members = members
        self._scratch: dict[int, object] = {}  # receive buffers of swapped buckets, for `_layout`
        self._layout = None

    @property
    def device_work(self) -> bool:
        """Whether CUDA buckets are all-reduced where they are (NCCL), not from pinned copies."""
        return self.members.nccl is not None

    def arena_for(self, layout, host: bool, lengths: list[int]):
        """No bucket memory of its own: the staging allocates its buffers (see ShmCollective)."""
        return None

    def begin(self, layout, staging) -> None:
        on_device = staging.on_device
        self.on_device = on_device
        self.group = self.members.nccl if on_device else self.members.gloo
        if self._layout is not layout:  # new buckets: new receive buffers
            self._scratch, self._layout = {}, layout
            if self.members.size == 2:
                room = self.SWAP_SCRATCH_BYTES
                for pid, part in enumerate(layout.parts):
                    if part.length * 4 <= min(self.SWAP_BUCKET_BYTES, room):
                        self._scratch[pid] = None  # allocated at its first swap
                        room -= part.length * 4

    def start(self, pid: int, sent, view, what: str):
        """The bucket's all-reduce, as a swap with the other member where it qualifies (a
        small bucket in host memory: device buffers go to NCCL's all-reduce)."""
        if not self.on_device:
            p2p.host_only(view, f"all-reducing bucket {pid} over gloo")
        if pid not in self._scratch or self.on_device:
            return dist.all_reduce(sent, group=self.group, async_op=True)
        if self._scratch[pid] is None:  # with room for a cargo's trailer
            self._scratch[pid] = view.new_empty(view.numel() + CARGO_ROOM)
        scratch = self._scratch[pid][:sent.numel()]
        me = self.ctx.rank
        peer = next(r for r in self.members.ranks if r != me)
        return p2p.Swap(sent, scratch, peer, p2p.PAIR(pid % p2p.PAIR.size), self.group, f"swapping bucket {pid}")


class ShmCollective:
    """The members' shared segments (comm/shm/select.py builds them at the first step,
    when every member is in lockstep): the buckets of a staging that allocated them in an
    arena (`arena_for`) are summed there; any other bucket goes through the host group's
    rounds (`build`)."""

    def __init__(self, ctx, members, cuda: bool):
        self.ctx = ctx
        self.members = members
        self.cuda = cuda
        self.host = None  # the HostGroup, made at the first `begin`
        self.fallback: ProcessGroupCollective | None = None  # where /dev/shm has no room (host buffers)
        self.arena = None  # the ArenaGroup holding the buckets of the staging in use (None: rounds)
        self._made: tuple = (None, None)  # (layout, its ArenaGroup or None): arena_for's last answer

    @property
    def device_work(self) -> bool:
        return self.cuda

    def arena_for(self, layout, host: bool, lengths: list[int]):
        """The `ArenaGroup` whose segments hold `layout`'s buffers of `lengths` elements, for
        the staging to allocate them in, in that order (comm/shm/arena.py), or None: where a
        member's tensors are on a GPU (`host` False on that member) or /dev/shm has no room,
        the buckets go through the host group's rounds. Every member asks once per new
        layout (the engine builds its staging at the same step everywhere), since the
        members agree on the answer. None at once for a group that keeps no buckets of its
        own (an exchange set's)."""
        if not self.members.keeps_buckets:
            return None
        if self._made[0] is not layout:
            from ..shm.select import build_arena

            self._made = (layout, build_arena(self.ctx, self.members, lengths, host))
        return self._made[1]

    def begin(self, layout, staging) -> None:
        self.arena = getattr(staging, "arena", None)
        if self.arena is not None:
            return
        if self.host is None and self.fallback is None:
            from ..shm.select import build

            self.host = build(self.ctx, self.members, self.cuda)
            if self.host is None:
                self.fallback = ProcessGroupCollective(self.ctx, self.members)
        if self.fallback is not None:
            self.fallback.begin(layout, staging)

    def start(self, pid: int, sent, view, what: str):
        if self.arena is not None:  # the bucket lies in the arena: summed where it is
            return self.arena.start(sent, what=f"{what} (bucket {pid})")
        if self.fallback is not None:
            return self.fallback.start(pid, sent, view, what)
        return self.host.start(sent, what=f"{what} (bucket {pid})")

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None


def collective_for(ctx, members):
    """The strategy for this transport's buckets, decided once: shared memory where every
    member shares this host and the members have no NCCL group (a host's GPUs talk over
    NCCL), torch.distributed otherwise."""
    from ..shm.select import usable

    if members.nccl is None and usable(ctx, members):
        return ShmCollective(ctx, members, cuda=ctx.device.type == "cuda")
    return ProcessGroupCollective(ctx, members)


def local_shm(ctx) -> ShmCollective | None:
    """Shared memory for the in-host reduce and broadcast of a machine's workers (host
    buffers; a machine whose workers have NCCL keeps it for device buffers), or None
    where it cannot be used: decided once, from the topology."""
    from ..group import Group
    from ..shm.select import usable

    if getattr(ctx, "local_host_groups", None) is None:
        return None
    members = Group(f"local-{ctx.machine_name}", tuple(ctx.local_ranks), ctx.local_host_groups[0])
    return ShmCollective(ctx, members, cuda=False) if usable(ctx, members) else None
