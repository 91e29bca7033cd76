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

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from ...errors import UserError
from ...runtime.shmnames import segment_name
from .segment import DONE, REDUCED, WRITTEN, Segment
from .waits import Waiter

DEFAULT_CAPACITY = 64 << 20  # bytes per member: two and a half of DDP's 25 MiB buckets
_ALIGN = 16  # slice bounds in elements: 64 bytes of fp32, a cache line
_WIDE = (torch.float16, torch.bfloat16)


class ShmWork:
    """An all-reduce in flight on the group's thread: `wait()` and `is_completed()` as a
    torch.distributed work object has them."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> bool:
        self.future.result()
        return True

    def is_completed(self) -> bool:
        return self.future.done()


class HostGroup:
    """Member `rank` of the host group `ranks` of job `job_id` (segments named by `key`,
    e.g. the round and the group's name). `barrier()` synchronises the members once while
    the segments are made and mapped (control only: a gloo barrier or the like); no data
    goes through it. `lost()` gives ranks the launcher knows to be dead or hung."""

    def __init__(self, job_id: str, secret: str, key: str, ranks: Sequence[int], rank: int,
                 barrier: Callable[[], None], capacity: int = DEFAULT_CAPACITY, timeout_s: float = 60.0,
                 lost: Callable[[], list[int]] | None = None):
        if rank not in ranks or len(ranks) < 2:
            raise UserError(f"a shared-memory group needs this rank ({rank}) among two or more ranks, got {list(ranks)}")
        self.ranks = list(ranks)
        self.index = self.ranks.index(rank)
        self.size = len(self.ranks)
        names = [segment_name(job_id, secret, f"{key}-{r}") for r in self.ranks]
        self.segments: list[Segment] = []
        mine = Segment.create(names[self.index], secret, capacity)
        try:
            barrier()  # every member has made its segment
            self.segments = [mine if i == self.index else Segment.attach(n, secret) for i, n in enumerate(names)]
            barrier()  # every member has mapped every segment: the names can go
        except BaseException:
            for s in self.segments or [mine]:
                s.close()
            raise
        finally:
            mine.unlink()
        sizes = {s.capacity for s in self.segments}
        if len(sizes) != 1:
            raise UserError(f"the members of shared-memory group {key} made segments of different sizes {sorted(sizes)}")
        self.capacity = capacity
        self.waiter = Waiter(self.ranks, [s.pid for s in self.segments], timeout_s, lost)
        self.round = 0
        self._queue: queue.SimpleQueue | None = None
        self._scratch: torch.Tensor | None = None  # fp32 accumulator of fp16/bf16 slices

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

    def start(self, t: torch.Tensor, average: bool = False, what: str = "all-reducing") -> ShmWork:
        """`all_reduce` on the group's thread (members start theirs in the same order)."""
        return self.submit(self.all_reduce, t, average, what)

    def submit(self, fn, *args) -> ShmWork:
        """`fn(*args)` (one of this group's collectives) on the group's thread, after those
        submitted before it: every member submits the same collectives in one order."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._queue,), name="hetrain-shm", daemon=True).start()
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return ShmWork(fut)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise UserError(f"a shared-memory all-reduce takes a contiguous host tensor, got one on {t.device}"
                            f"{'' if t.is_contiguous() else ' (not contiguous)'}")
        return t.view(-1)

    def _bounds(self, m: int) -> list[int]:
        cuts = [(m * k // self.size) // _ALIGN * _ALIGN for k in range(self.size)]
        return cuts + [m]

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

    def _reduce(self, out: torch.Tensor, parts: list[torch.Tensor], average: bool) -> None:
        """Sum of `parts` into `out` (which may be parts[0]; fp16/bf16 through an fp32
        accumulator, rounded once)."""
        if out.dtype in _WIDE:
            n = out.numel()
            if self._scratch is None or self._scratch.numel() < n:
                self._scratch = torch.empty(n, dtype=torch.float32)
            acc = self._scratch[:n]
            acc.copy_(parts[0])
            for p in parts[1:]:
                acc.add_(p)
            if average:
                acc.div_(self.size)
            out.copy_(acc)
            return
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)
        if average:
            if not out.is_floating_point():
                raise UserError(f"averaging needs a floating-point tensor, got {out.dtype}")
            out.div_(self.size)

    # ---- end -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread and unmap every segment (the names went at set-up)."""
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None
        for s in self.segments:
            s.close()
        self.segments = []


def _serve(jobs: queue.SimpleQueue) -> None:
    """The group's thread: runs its all-reduces in the order they were started. A daemon
    thread (not an executor's, which interpreter exit joins): a process that leaves in
    the middle of a step must not wait for peers that will never come."""
    while True:
        job = jobs.get()
        if job is None:
            return
        fut, fn, args = job
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args))
        except BaseException as err:  # handed to whoever waits on the work
            fut.set_exception(err)
