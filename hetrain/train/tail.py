"""The dynamic tail of a balanced step: the last part of every global batch is handed out
while the step runs, a chunk at a time, to whichever worker asks first.

Why: shares are solved from step-time fits, but a worker's speed moves from step to step
(another process on its core, cache and memory-bandwidth contention, a co-tenant of the
virtual machine). A step ends when the slowest worker does, so workers balanced on their
mean speeds pay the expected maximum of their noise every step. With a tail, a worker
that runs late this step claims fewer chunks and the others more, so the workers finish
within about one chunk of each other. Every sample of the global batch is still trained
on exactly once in its step, so the update is the same as without a tail.

How: a counter per step in the job's key-value store (torch.distributed's TCPStore,
which the launcher serves; an atomic `add` per claim, one round trip). A claim adds the
claimant's chunk size and takes the samples just below the new value, so chunks
can differ per worker: each is sized to take its worker about the same time (a slow
worker's last chunk would otherwise decide the step's end). Each claimer claims until a
claim starts past the tail or takes its last sample. Steps use keys of their own, so a
worker that runs ahead cannot take another step's samples; the key of a step long over
is deleted (by worker 0, `lag` steps later: the balancer's exchange bounds a worker's
lead to twice its interval), so the store holds a fixed number of keys however long the
job.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import UserError

__all__ = ["TailSplit", "split_tail", "TailClaims", "Store"]


class Store(Protocol):
    """What the claims need of a store: torch.distributed's `Store.add` (atomic) and
    `delete_key`."""

    def add(self, key: str, amount: int) -> int: ...

    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True)
class TailSplit:
    """One step's split: `static[i]` samples handed to worker i up front (contiguous, in
    worker order), then the rest of the batch from offset `start`, claimed while the step
    runs, `chunk[i]` samples at a time by worker i (0: it takes no part)."""

    static: np.ndarray
    start: int
    total: int
    chunk: np.ndarray

    @property
    def held(self) -> int:
        """Samples in the tail."""
        return self.total - self.start


def split_tail(sizes, fraction: float, chunks_per_worker: int = 3, micro: int = 0) -> TailSplit:
    """Hold back about `fraction` of each worker's share for the tail.

    A worker keeps at least one sample up front (its local batch size weights its gradient
    in the average, so it must be > 0 for its tail chunks to count), and a worker without
    a share (too slow to help, or out of memory) neither gets nor claims any. Worker i's
    chunk is its held-back samples / `chunks_per_worker`: chunks take every worker about
    the same time, and each worker expects that many (fewer passes pay the per-pass fixed
    part less often, more balance finer). Accumulating (`micro` > 0), the tail is whole
    micro-batches and every chunk one, so every pass still sees the same batch size."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if not 0.0 <= fraction < 1.0:
        raise UserError(f"tail must be a fraction of the batch in [0, 1), got {fraction}")
    if chunks_per_worker < 1:
        raise UserError(f"tail_chunks must be >= 1 chunk per worker, got {chunks_per_worker}")
    if micro > 0:
        take = micro * np.minimum(np.maximum(sizes // micro - 1, 0),
                                  np.floor(sizes * fraction / micro).astype(np.int64))
    else:
        take = np.minimum(np.maximum(sizes - 1, 0), np.floor(sizes * fraction).astype(np.int64))
    total = int(sizes.sum())
    if int(take.sum()) == 0 or int((sizes > 0).sum()) < 2:  # nothing held back, or no one to balance against
        return TailSplit(sizes, total, total, np.zeros(len(sizes), dtype=np.int64))
    static = sizes - take
    if micro > 0:
        chunk = np.where(sizes > 0, micro, 0)
    else:  # a worker with nothing held back still claims, a sample at a time (it may finish first)
        chunk = np.where(sizes > 0, np.maximum(1, -(-take // chunks_per_worker)), 0)
    return TailSplit(static, int(static.sum()), total, chunk.astype(np.int64))


_serials: dict[tuple[int, int], itertools.count] = {}


class TailClaims:
    """This worker's claims on the tail of the steps of one loader.

    Keys are made from a per-(store, rank) serial: every worker must build its balanced
    loaders in the same order (as it must iterate them in the same order), so the n-th
    loader of every worker claims from the same keys."""

    def __init__(self, store: Store, rank: int, lag: int = 8):
        self.store = store
        serial = next(_serials.setdefault((id(store), rank), itertools.count()))
        self.key = f"hetrain/tail/{serial}"
        self.lag = lag  # steps after which worker 0 deletes a step's key
        self.me = rank
        self.steps = 0  # steps begun
        self.split: TailSplit | None = None
        self.claimed = 0  # samples claimed this step
        self.done = True  # this worker made its last claim of the step (or takes no part)

    def begin(self, split: TailSplit) -> None:
        """A new step with this split (the previous one must be over: `end`)."""
        self.split = split
        self.steps += 1
        self.claimed = 0
        self.done = not (split.held and split.chunk[self.me])
        if self.me == 0 and self.steps > self.lag:
            self.store.delete_key(f"{self.key}/{self.steps - self.lag}")

    def claim(self) -> tuple[int, int] | None:
        """The next chunk's (lo, hi) in the batch, or None: the tail is used up (this
        worker's last claim of the step)."""
        s = self.split
        if s is None or self.done:
            return None
        n = int(s.chunk[self.me])
        try:
            top = int(self.store.add(f"{self.key}/{self.steps}", n))
        except RuntimeError as err:  # the store's server (the launcher) is gone or does not answer
            raise RuntimeError(f"claiming samples of step {self.steps}'s tail from the job's store failed ({err}); the "
                               "launcher that serves the store stopped or is unreachable: restart the job from its "
                               "last checkpoint") from None
        if top - n >= s.held:
            self.done = True
            return None
        lo, hi = s.start + top - n, s.start + min(top, s.held)
        self.claimed += hi - lo
        # this chunk reached the tail's end: every later claim would start past it, so
        # none is made (a store round trip saved per worker and step)
        self.done = top >= s.held
        return lo, hi

    def end(self) -> None:
        """Close the step. Raises if this worker took part but stopped claiming early (the
        tail's samples would not all be trained on)."""
        s, self.split = self.split, None
        if s is not None and not self.done:
            raise UserError("a balanced loader with tail= hands out the end of every step while it runs: iterate "
                            "`for mx, my in loader.micro_batches(x, y)` to the end in every step (it claims those "
                            "samples), or set tail=0")
