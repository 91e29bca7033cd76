"""The layouts a job has agreed on, remembered so that one coming back is not rebuilt.

A training step can alternate between exchanges of different tensors: two optimizers
(a GAN's discriminator and generator, embeddings and dense layers), or a push_pull of
the loss between steps. Each one's layout (its partitions, staging buffers, tuned
buckets, codec residuals and, on a summation server, the receives posted for its next
step) is kept under its digest, and when it comes back its epoch (the block of partition
tags) is the one it had. Every rank sees the same sequence of agreed digests (the step
header), so every rank's `KnownLayouts` holds the same digests with the same epochs,
without a word exchanged: a layout known here is known everywhere, and its manifest need
not travel again.

Only the last `CAPACITY` layouts are kept: a job issuing ever new tensor lists (a
push_pull per metric name) does not grow memory without bound; an evicted layout that
comes back is new again (a new epoch, so receives still posted for its old one, on a
server, never meet it)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

CAPACITY = 8

T = TypeVar("T")


class KnownLayouts(Generic[T]):
    """Agreed layouts by digest: each one's epoch, and the state its holder keeps for it
    while another layout is in use (`stash` / `take`)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.epochs: OrderedDict[int, int] = OrderedDict()
        self.count = 0  # layouts made so far: the next new one gets epoch count + 1
        self._state: dict[int, T] = {}

    def switch(self, digest: int) -> tuple[int, bool]:
        """The layout `digest` is agreed now: its epoch, and whether it was known (kept)."""
        if digest in self.epochs:
            self.epochs.move_to_end(digest)
            return self.epochs[digest], True
        self.count += 1
        self.epochs[digest] = self.count
        while len(self.epochs) > self.capacity:
            old, _ = self.epochs.popitem(last=False)
            self._state.pop(old, None)
        return self.count, False

    def stash(self, digest: int, state: T) -> None:
        """Keep `state` for layout `digest` (the one being left), if it is still known."""
        if digest in self.epochs:
            self._state[digest] = state

    def take(self, digest: int) -> T | None:
        """The state kept for `digest` (and forget it: its holder owns it again)."""
        return self._state.pop(digest, None)
