"""When a set of several workers gives way, for a few steps, to a subset of it never
measured: the check the fits cannot make.

The balancer picks the workers of a step from predictions (each worker's fitted compute
and the measured exchange of the set: `hetrain.perf.exchangeset`), and measured step
times veto a set that ran slower than another that also ran (train/set_times.py). A
subset the predictions never pick is never measured, so nothing vetoes the set in use.
Where workers share a host's cores, that is the case that matters: each worker is fitted
while the others compute beside it, so every fit is slower than the worker runs alone,
and a lone worker's step is predicted from a fit the set's contention slowed. On a 2-core
host, two one-thread workers and their summation servers were kept together at 6 ms a
step for 200 steps where either alone ran 4 ms (`bench/hetero_real.py --cpu-dry-run`).

So once a set of several workers has run measured for `every` steps (the balancer's
`window`: a trial costs a few steps, and a pair kept together wrongly costs a third or
more of every step it runs), the fastest subset of it that was never measured (the k
fastest workers alone: `fastest_sets`) is given the batch until it is measured too (its
first report, `MEASURED_AFTER`, or `limit` steps); the measurements then decide between
the two (`SetTimes.better`), and the fits of the subset's workers are its own. Each trial
doubles the wait before the next, as probes do: a set that is rightly in use costs a few
steps over a whole run. Every worker decides the same at the same exchange, from the same
agreed plan, record and exchange step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass
class SubsetTrial:
    """Which subset, if any, the full batch's next plan gives the batch to (`propose`)."""

    every: int  # steps a measured set of several runs before its first trial (0: never)
    limit: int  # steps a trial lasts at most (the subset not measured by then: it ends anyway)
    gap: int = 0  # the current wait (doubles after each trial)
    since: int | None = None  # the exchange step since which the set in use ran measured
    active: np.ndarray | None = None  # the subset on trial
    started: int = 0
    of: bytes = b""  # the set `since` counts for (another set in use starts the wait again)

    def __post_init__(self) -> None:
        self.gap = self.every

    def due(self, step: int, current: np.ndarray, current_measured: bool) -> bool:
        """Whether a subset is on trial at exchange `step`, or may go on trial now, while the
        set `current` (bool mask) is in use, its step measured or not: then the balancer
        solves and asks `propose`; else the plan stands (no solve). Counts the wait."""
        if self.every <= 0:
            return False
        if self.active is not None:
            return True
        if int(current.sum()) < 2 or not current_measured:
            self.since = None
            return False
        if self.since is None or current.tobytes() != self.of:
            self.since, self.of = step, current.tobytes()
        return step - self.since >= self.gap

    def propose(self, step: int, current: np.ndarray, current_measured: bool, candidates: Sequence[np.ndarray],
                measured: Callable[[np.ndarray], bool]) -> np.ndarray | None:
        """The subset (bool mask) to give the full batch at exchange `step`, or None: the
        plan stands. `current` is the set of the plan chosen without a trial,
        `current_measured` whether its step was measured, `candidates` the fastest sets
        (smallest first), `measured(mask)` whether a set's step was measured."""
        if self.active is not None:
            if not measured(self.active) and step - self.started < self.limit:
                return self.active
            self.active, self.gap, self.since = None, 2 * self.gap, step  # over: the measurements decide
            return None
        if not self.due(step, current, current_measured):
            return None
        for mask in candidates:
            if bool((mask <= current).all()) and int(mask.sum()) < int(current.sum()) and not measured(mask):
                self.active, self.started = mask.copy(), step
                return self.active
        self.since = step  # every subset measured: the record decides already; look again a wait later
        return None
