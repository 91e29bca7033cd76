"""When a worker that sits out gets a share again, to be measured.

A worker whose best share is zero (too slow to help, or under `small_share`) trains on
no sample, so it records no step time and its fit stands still: fitted while it was
slow, that fit would keep it out for good after its speed recovered (the interference
ended, the other tenant left). So while a worker sits out, every so often the step is
split with every worker in it for a few steps (enough to move the median its level is:
`StepTimeModel`), and the fits decide again. Each probe after which it stays out doubles
the wait, so a worker that stays slow costs a few steps over a whole run, as the
launcher's cool-down before it retries a machine doubles each time that machine fails.
A worker that rejoins and leaves again within a first wait (the set it rejoined ran
slower than a set measured before it: train/set_times.py) is still slow: the wait goes
on doubling; only a whole first wait with every worker in starts it again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Probe:
    """Which steps are probe steps. Every worker asks for the same step counts with the
    same answer to "does a worker sit out" (the agreed plan), so all agree."""

    every: int  # steps a worker sits out before the first probe (0: never)
    steps: int  # steps a probe lasts
    gap: int = 0  # the current wait (doubles after each probe)
    at: int | None = None  # the step the next probe starts at
    left: int = 0  # probe steps still to run
    in_since: int | None = None  # the step since which every worker is in

    def __post_init__(self) -> None:
        self.gap = self.every

    def due(self, step: int, someone_out: bool) -> int | None:
        """Which step of a probe step `step` is (0, 1, ...), or None: not a probe step,
        given whether the current plan leaves a worker out (a probe under way runs to its
        end either way)."""
        if self.every <= 0:
            return None
        if self.left == 0:
            if not someone_out:  # everyone in for a whole first wait: the next worker to leave waits it
                self.in_since = step if self.in_since is None else self.in_since
                if step - self.in_since >= self.every:
                    self.gap, self.at = self.every, None
                return None
            self.in_since = None
            if self.at is None:
                self.at = step + self.gap
            if step < self.at:
                return None
            self.left, self.gap = self.steps, 2 * self.gap
            self.at = step + self.steps + self.gap
        self.left -= 1
        return self.steps - self.left - 1


SIZES = (1.0, 1.5, 0.5)  # a probe's steps measure these multiples of the probe share, in turn


def probe_sizes(sizes: np.ndarray, out: np.ndarray, share, k: int) -> np.ndarray:
    """`sizes` with every worker in `out` given its `share` (one for all, or one each) x
    SIZES[k % 3] samples (at least one), taken from the others in proportion to their
    shares. Three sizes, so the worker's own steps identify its fixed and per-sample
    parts afresh: the shape fitted before (a stall is all fixed time, say) says nothing
    of its speed now."""
    sizes = np.asarray(sizes, dtype=np.int64).copy()
    mult = SIZES[k % len(SIZES)]
    give = np.where(out, np.maximum(1, np.round(np.broadcast_to(share, sizes.shape) * mult)), 0).astype(np.int64)
    rest = int(sizes.sum())
    take = min(int(give.sum()), rest - int((~out).sum()))  # every other worker keeps a sample
    if take <= 0:
        return sizes
    give = np.floor(give * take / give.sum()).astype(np.int64)
    cut = np.floor(sizes * (give.sum() / max(1, sizes[~out].sum()))).astype(np.int64) * (~out)
    cut[np.argmax(np.where(out, -1, sizes))] += int(give.sum() - cut.sum())
    return sizes - cut + give
