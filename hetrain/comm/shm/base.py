"""What every shared-memory group of one host's processes shares (`SegmentGroup`): each
member's segment (segment.py) made, mapped by every other member and unlinked, the
waits on the peers' control counters (waits.py), the thread that runs the collectives
in the order they were started, the sum of a slice over the members, and the end.

Two groups build on it: `HostGroup` (group.py) all-reduces tensors the caller owns, in
rounds through its segment; `ArenaGroup` (arena.py) all-reduces buckets that live in the
segments themselves.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from ...errors import UserError
from ...runtime.shmnames import segment_name
from .segment import Segment
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


class SegmentGroup:
    """What every shared-memory group of processes on one host has. This process is
    member `rank` of the host group `ranks` of job `job_id` (segments named by `key`,
    e.g. the round and the group's name). `barrier()` synchronises the members once while
    the segments are made and mapped (control only: a gloo barrier or the like); no data
    goes through it. `lost()` gives ranks the launcher knows to be dead or hung.

    The collectives (`all_reduce` and the like) are the subclasses': `start` and `submit`
    run them on the group's thread, in the order they were started."""

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

    def _bounds(self, m: int) -> list[int]:
        cuts = [(m * k // self.size) // _ALIGN * _ALIGN for k in range(self.size)]
        return cuts + [m]

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
