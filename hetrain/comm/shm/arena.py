"""Buckets that live in shared memory: the all-reduce staging's buffers allocated in the
members' segments, so a bucket is summed where backward wrote it.

A `HostGroup` (group.py) all-reduces a tensor the caller owns: it copies the tensor into
its segment, sums, and copies the result back, moving about 5.5 times the tensor's bytes
per process, as much as gloo's loopback copies. Here the transport owns the staging
instead: the in-place host staging (comm/staging/inplace.py) asks the `ArenaGroup` of
its layout for every bucket buffer (`alloc`), and the optimizer points each gradient at
its piece of a bucket (PyTorch DDP's `gradient_as_bucket_view`), so backward accumulates
into this process's segment and no copy in or out is left.

Every member allocates the same buckets in the same order, so a bucket sits at the same
offset in every member's segment. Its all-reduce is one round of two phases:

1. WRITTEN: the member's bucket is final (published when the engine starts it);
2. once every member has written, member i sums slice i of the bucket over every
   segment and writes the sum into slice i of *every* segment (the
   reducer pushes its result; nobody gathers), then publishes REDUCED.

Once every member has reduced, this process's bucket holds the whole sum and no peer
reads or writes its segment again until it publishes WRITTEN for the next round: the
caller may write its gradients (clipping, zero_grad, the next backward) as soon as the
round returns. Per process that is a read of N and a write of N/n to sum, and (n-1)N/n
read and written to push: (1.5 - 0.5/n)·N/S for an N-byte bucket among n processes at
memcpy speed S, against (2.75 + 0.25/n)·N/S with the copies in and out.
"""
from __future__ import annotations

import torch

from ...errors import UserError
from .base import SegmentGroup
from .segment import DONE, REDUCED, WRITTEN

ALIGN_BYTES = 64  # every bucket starts on a cache line
# elements summed and pushed at a time: 256 KiB of fp32, so the partial sum stays in the
# core's cache between the adds and the copies (each pass over a whole slice would read
# and write it from memory again: about half the traffic for 4 members)
CHUNK = 1 << 16


def arena_bytes(lengths: list[int]) -> int:
    """Bytes of segment holding fp32 buckets of `lengths` elements, each aligned."""
    return sum(-(-n * 4 // ALIGN_BYTES) * ALIGN_BYTES for n in lengths)


class ArenaGroup(SegmentGroup):
    """A host group whose segments hold one layout's buckets (see the module docstring).
    `alloc(numel)` gives the next bucket buffer in this process's segment: every member
    must allocate the same sizes in the same order. `all_reduce(t)`, `reduce(t, root)`
    and `broadcast(t, root)` take a tensor that lies in this process's arena (a bucket,
    or a bucket with its cargo's trailer); after each returns, no peer reads or writes
    this process's segment until its next round."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._next = 0  # bytes of this process's segment allocated so far
        mine = self.segments[self.index].data
        self._base = mine.data_ptr()

    def alloc(self, numel: int) -> torch.Tensor:
        """The next fp32 buffer of `numel` elements in this process's segment."""
        nbytes = -(-numel * 4 // ALIGN_BYTES) * ALIGN_BYTES
        if self._next + nbytes > self.capacity:
            raise UserError(f"the shared-memory arena of {self.capacity} bytes has no room for another {nbytes}: "
                            "every bucket is allocated once per layout, in the size it was made for")
        lo = self._next
        self._next += nbytes
        return self.segments[self.index].data[lo:lo + numel * 4].view(torch.float32)

    def offset(self, t: torch.Tensor) -> int | None:
        """Where contiguous fp32 `t` starts in this process's arena, in elements (None:
        it does not lie there)."""
        off = t.data_ptr() - self._base
        if (t.dtype != torch.float32 or not t.is_contiguous() or off < 0 or off % 4
                or off + t.numel() * 4 > self._next):
            return None
        return off // 4

    def _views(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """`t` (in this process's arena) at its offset in every member's segment."""
        off = self.offset(t)
        if off is None:
            raise UserError(f"{what} over a shared-memory arena takes a buffer allocated from it (`alloc`), got "
                            f"a {t.dtype} tensor of {t.numel()} elements elsewhere")
        return [seg.data.view(torch.float32)[off:off + t.numel()] for seg in self.segments]

    def _sum_slice(self, views: list[torch.Tensor], into: list[int], average: bool) -> None:
        """This member's slice of the buffer summed over `views` into member `into[0]`'s
        view (summed in place, so its part is added first) and copied to the views of
        the other members in `into`, a chunk at a time (see CHUNK)."""
        i, first = self.index, into[0]
        b = self._bounds(views[0].numel())
        rest = [v for j, v in enumerate(views) if j != first]
        for lo in range(b[i], b[i + 1], CHUNK):
            hi = min(b[i + 1], lo + CHUNK)
            acc = views[first][lo:hi]
            self._reduce(acc, [acc] + [v[lo:hi] for v in rest], average)
            for j in into[1:]:
                views[j][lo:hi].copy_(acc)

    def all_reduce(self, t: torch.Tensor, average: bool = False, what: str = "all-reducing") -> torch.Tensor:
        """Sum (or average) `t`, which lies in this process's arena, over the members'
        copies at the same offset; in place, returns `t`."""
        views = self._views(t, what)
        s = self.round + 1
        i, segs, wait = self.index, self.segments, self.waiter.until
        segs[i].set_counter(WRITTEN, s)
        wait(segs, WRITTEN, s, what, skip=i)
        # one member sums each slice, so every member gets its bits
        self._sum_slice(views, [i] + [j for j in range(self.size) if j != i], average)
        segs[i].set_counter(REDUCED, s)
        wait(segs, REDUCED, s, what, skip=i)
        self.round = s
        return t

    def reduce(self, t: torch.Tensor, root: int, what: str = "reducing") -> torch.Tensor:
        """Sum `t` (in the arena) into member `root`'s copy (a job rank): each member sums
        its slice and writes it into the root's segment only (as dist.reduce, only the
        root's result is defined). Two phases, as `all_reduce`."""
        views = self._views(t, what)
        s = self.round + 1
        i, segs, wait = self.index, self.segments, self.waiter.until
        segs[i].set_counter(WRITTEN, s)
        wait(segs, WRITTEN, s, what, skip=i)
        self._sum_slice(views, [self.ranks.index(root)], False)
        segs[i].set_counter(REDUCED, s)
        wait(segs, REDUCED, s, what, skip=i)
        self.round = s
        return t

    def broadcast(self, t: torch.Tensor, root: int, what: str = "broadcasting") -> torch.Tensor:
        """Member `root`'s copy of `t` (in the arena) into every member's: the others copy
        it out of the root's segment once it says WRITTEN, then say DONE; the root waits
        for every DONE, so its buffer is its own again when the round returns."""
        views = self._views(t, what)
        s = self.round + 1
        i, segs, wait = self.index, self.segments, self.waiter.until
        src = self.ranks.index(root)
        segs[i].set_counter(WRITTEN, s)
        if i != src:
            wait(segs, WRITTEN, s, what, skip=i)  # the root's among them
            views[i].copy_(views[src])
        segs[i].set_counter(DONE, s)
        if i == src:
            wait(segs, DONE, s, what, skip=i)
        self.round = s
        return t
