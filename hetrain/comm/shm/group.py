"""A group of processes on one host that all-reduce through shared segments.

Each member owns one segment (segment.py) and maps every other member's. An all-reduce
of a tensor runs in rounds of at most a segment's capacity, each in three phases, every
member working in parallel on its own slice (memcpy-bound, no socket, no extra copy):

1. copy in: the member copies its chunk into its own segment, then publishes WRITTEN;
2. reduce-scatter: once every member has written, member i sums slice i of every
   segment, in member order (fp16/bf16 accumulated in fp32, rounded once), into its
   result tensor and back into slice i of its own segment, then publishes REDUCED;
3. all-gather: once every member has reduced, member i copies slice j from segment j
   for every j != i, then publishes DONE.

A member writes its segment for the next round only after every member is DONE with
this one, so the three counters per segment are the whole control channel. Slice i of
each result is computed by one member and copied by the others, so every member gets
the same bits. Members issue all-reduces in one order (a transport's fixed order), run
by one background thread (`start`), so a caller overlaps them with its compute as with
gloo's asynchronous work.
"""
from __future__ import annotations

import torch

from ...errors import UserError
from .base import DEFAULT_CAPACITY, SegmentGroup, ShmWork
from .segment import DONE, REDUCED, WRITTEN

__all__ = ["DEFAULT_CAPACITY", "HostGroup", "ShmWork"]


class HostGroup(SegmentGroup):
    """All-reduce, reduce and broadcast of tensors the caller owns, in rounds through the
    members' segments (see the module docstring); `SegmentGroup` takes the same arguments."""

    # ---- the collective --------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, average: bool = False, what: str = "all-reducing") -> torch.Tensor:
        """Sum (or average) `t` over the members, in place; returns `t`."""
        flat = self._flat(t)
        cap = self.capacity // flat.element_size()
        for lo in range(0, flat.numel(), cap):
            self._round(flat[lo:lo + cap], average, what)
        return t

    def reduce(self, t: torch.Tensor, root: int, what: str = "reducing") -> torch.Tensor:
        """Sum `t` into member `root`'s `t` (a job rank); the others' `t` then hold their
        own slice of the sum (only the root's result is defined, as with dist.reduce).
        The same rounds as `all_reduce`, with only `root` gathering."""
        flat = self._flat(t)
        cap = self.capacity // flat.element_size()
        for lo in range(0, flat.numel(), cap):
            self._round(flat[lo:lo + cap], False, what, gather=self.ranks.index(root) == self.index)
        return t

    def broadcast(self, t: torch.Tensor, root: int, what: str = "broadcasting") -> torch.Tensor:
        """Member `root`'s `t` (a job rank) into every member's `t`."""
        flat = self._flat(t)
        cap = self.capacity // flat.element_size()
        src = self.ranks.index(root)
        for lo in range(0, flat.numel(), cap):
            self._copy_round(flat[lo:lo + cap], src, what)
        return t

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise UserError(f"a shared-memory all-reduce takes a contiguous host tensor, got one on {t.device}"
                            f"{'' if t.is_contiguous() else ' (not contiguous)'}")
        return t.view(-1)

    def _round(self, x: torch.Tensor, average: bool, what: str, gather: bool = True) -> None:
        s = self.round + 1
        i, segs, wait = self.index, self.segments, self.waiter.until
        m, dtype = x.numel(), x.dtype
        views = [seg.view(dtype, m) for seg in segs]
        b = self._bounds(m)
        lo, hi = b[i], b[i + 1]
        wait(segs, DONE, s - 1, what, skip=i)  # every member has gathered the last round's slices
        self._copy_in(x, views[i], lo, hi)
        segs[i].set_counter(WRITTEN, s)
        wait(segs, WRITTEN, s, what, skip=i)
        if hi > lo:
            self._reduce_slice(x, views, lo, hi, average)
        segs[i].set_counter(REDUCED, s)
        wait(segs, REDUCED, s, what, skip=i)
        if gather:
            self._gather(x, views, b, s)
        segs[i].set_counter(DONE, s)
        self.round = s

    def _copy_round(self, x: torch.Tensor, src: int, what: str) -> None:
        """One round of a broadcast: `src` writes its chunk, the others copy it out."""
        s = self.round + 1
        i, segs, wait = self.index, self.segments, self.waiter.until
        wait(segs, DONE, s - 1, what, skip=i)
        theirs = segs[src].view(x.dtype, x.numel())
        if i == src:
            self._copy_in(x, theirs)
            segs[i].set_counter(WRITTEN, s)
        else:
            segs[i].set_counter(WRITTEN, s)
            wait(segs, WRITTEN, s, what, skip=i)  # src's among them
            self._copy_out(x, theirs)
        segs[i].set_counter(REDUCED, s)
        segs[i].set_counter(DONE, s)
        self.round = s

    def _copy_out(self, x: torch.Tensor, theirs: torch.Tensor) -> None:
        x.copy_(theirs)

    def _copy_in(self, x: torch.Tensor, mine: torch.Tensor, lo: int = 0, hi: int = 0) -> None:
        """`x` into this member's segment but for [lo, hi), its own slice, which only it
        reads (from `x` itself: a copy less)."""
        mine[:lo].copy_(x[:lo])
        mine[hi:].copy_(x[hi:])

    def _gather(self, x: torch.Tensor, views: list[torch.Tensor], b: list[int], s: int) -> None:
        for j in range(self.size):
            if j != self.index and b[j + 1] > b[j]:
                x[b[j]:b[j + 1]].copy_(views[j][b[j]:b[j + 1]])

    def _reduce_slice(self, x: torch.Tensor, views: list[torch.Tensor], lo: int, hi: int, average: bool) -> None:
        """Slice [lo, hi) summed into the result (in place: this member's own part is
        `x`'s, added first) and into this member's segment for the others to copy. Each
        slice is summed by one member, so every member gets its bits."""
        mine = x[lo:hi]
        self._reduce(mine, [mine] + [v[lo:hi] for j, v in enumerate(views) if j != self.index], average)
        views[self.index][lo:hi].copy_(mine)

