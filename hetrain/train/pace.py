"""A worker that sits steps out paces its loop to the workers that train.

A worker with no samples in a step leaves its exchange (api/members.py): its loop still
runs every step (the user's step count, schedules and commits stay the same on every
worker), but each such step is a few hundred microseconds of bookkeeping and nothing
holds it back but the balancer's exchange of rows, which it completes up to two
exchanges ahead of the workers that train (train/balance_exchange.py). So it ran in
bursts: blocked, then released by the trainers' exchange, then a whole window of steps
at once. Where it shares cores with them (workers of one host, a GPU worker's feeding
threads beside CPU workers), a burst takes the cores at the moment the trainers resume:
on a 2-core host with two workers out beside one training alone (`bench/hetero_real.py
--cpu-dry-run`), the trainer's step after every exchange took twice its median, about
6% of its samples/s over a window of 16 steps.

So the steps this worker sits out keep to `PACE` of the trainers' measured step
(train/set_times.py): its work spreads over the steps it runs beside, and, at twice
their pace, it still stays ahead of them: it is never the worker an exchange waits for.
It waits once every `CHUNK` such steps, for what those steps owe. Every step: a sleep
costs its process 80-90 us of CPU on a virtual machine's timers (`bench/loop_overhead.py`:
a worker sitting out used about 170 us a step sleeping every step, 80 without pacing,
120 waiting every 4 steps), but on shared cores even 4 steps at once cost the trainer
more than that CPU: five alternating dry runs gave `mixed_over_best_subset` 0.968-0.995
(mean 0.980) waiting every step, 0.915-1.011 (mean 0.966) every 4. Where the set was not
measured yet, where half their step is under `MIN_WAIT`, or where its own loop is slower
than that anyway, it does not wait.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from .set_times import SetTimes

# a step sat out starts at most once per this fraction of the training set's step: 2x
# their pace, so the worker stays ahead of them while its work spreads over their steps
PACE = 0.5
CHUNK = 1  # steps sat out between two waits (each wait for all of them)
# no pace where half the trainers' step is shorter than this: a wait's own CPU (80-90 us)
# would be a fifth of it or more (`bench/loop_overhead.py`, steps of 0.5 ms: the trainer
# alone by speed went from 0.65 to 0.60 of the plain loop paced)
MIN_WAIT = 1e-3


class SitOutPace:
    """When a step this worker sits out may start (`begin`, at every step's start), from
    the agreed record of the sets' measured steps (`SetTimes`: a set's time is looked up
    once per change of the record, `SetTimes.version`, not per step)."""

    def __init__(self, times: SetTimes, pace: float = PACE, chunk: int = CHUNK,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.times, self.pace, self.chunk = times, pace, chunk
        self.clock, self.sleep = clock, sleep
        self.slept = 0.0  # seconds this worker waited in all (it sat out then: no step of its is slower)
        self._since: float | None = None  # the start of the first step sat out since the last wait
        self._steps = 0  # steps sat out since then, this one excluded
        self._period: tuple[tuple, int, float] | None = None  # (members, version, their step seconds)

    def period(self, members, step: int) -> float:
        """The measured step seconds of the workers `members` (indices); NaN where not measured."""
        ranks, version = tuple(members), self.times.version
        if self._period is None or self._period[:2] != (ranks, version):
            mask = np.zeros(self.times.n, dtype=bool)
            mask[list(ranks)] = True
            self._period = (ranks, version, float(self.times.time(mask, step)))
        return self._period[2]

    def begin(self, out: bool, members, step: int) -> float:
        """A step starts, which this worker sits `out` (no samples, not a probe's copies)
        among the training workers `members`. Every `chunk` steps sat out in a row, wait
        until `PACE` of the trainers' measured step per such step has passed since the
        first of them started. Returns the seconds waited."""
        now = self.clock()
        period = self.period(members, step) if out and members else math.nan
        if not (math.isfinite(period) and self.pace * period >= MIN_WAIT):  # it trains, or no pace worth keeping
            self._since = None
            return 0.0
        if self._since is None:
            self._since, self._steps = now, 0
        if self._steps < self.chunk:
            self._steps += 1
            return 0.0
        waited = self._since + self._steps * self.pace * period - now
        if waited > 0:
            self.sleep(waited)
            self.slept += waited
            now = self.clock()
        self._since, self._steps = now, 1  # this step is the next chunk's first
        return max(waited, 0.0)
