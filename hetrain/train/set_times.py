"""What each set of workers measured a step at while the job ran it: the check on the
balancer's predictions.

The balancer chooses who takes part in a step from predictions: each worker's fitted
compute (fixed + per-sample seconds) and the measured exchange of the set
(`hetrain.perf.exchangeset`). The fits take each worker's speed as its own. Where workers
share a host's cores, memory bandwidth or copy engines, it is not: a worker that computed
beside two others was fitted slower than it runs alone, and a set chosen on such fits (a
slower worker alone, a pair where one worker alone was faster) ran slower than the set
it replaced. Nothing in the fits can say so; only the steps the set ran can.

So every worker also times its steps, from one step's start to the next (what samples/s
are made of: compute, exchange, waiting, the training loop and the loader), reports the
median since its last report with the set it was in (`mine`, in the balancer's row), and
every worker keeps the same record from the same rows (`receive`): each set's step is the
median over the members that reported it, and its time is the median of its recent
reports (`time`). A set's first step after a change is not timed (it pays the set's
group, the re-synchronisation and new shapes once), nor a probe step (its split is not
the set's), nor an epoch's last, partial batch. A set that goes on at another split
(the balancer moved the shares of the same workers) starts afresh (`moved`): the steps
of the split before, the shares not yet settled say, are not its.

`better(members)` then vetoes a split whose set measured slower, recently, than another
set that ran: predictions propose sets, measurements decide between sets both measured.
A measurement stands until a probe measures one of the set's workers again
(train/probe.py: after 64 steps out, the wait doubling each time it stays out), and for
`FRESH` steps at most; then the set is priced by prediction again and tried again where
it is predicted best (its speed, or its neighbours', may have changed). A set never
measured is always tried where predicted best: that is how a set gets measured. So a set
that runs slower than its prediction costs a few steps after each probe, as a worker
that stays slow does.

Sets are keyed by a bitmask of their workers, carried as a float64 in the row: exact up
to 52 workers; larger jobs are not timed by set (`timed` is False), and the balancer
goes by predictions alone.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

FRESH = 256  # steps a set's measured time stands for it
# reports of a set before its time is used: one (each the median over its members of
# their steps since their last report). A set tried for two steps, then left on the
# fits' noise, was never measured and tried again and again (a loaded 2-core host)
MEASURED_AFTER = 1
MARGIN = 0.03  # a measured set is preferred only where faster by this fraction, at least
NOISE = 2.0  # ... and by this many standard errors of the two times' difference
MAX_WORKERS = 52  # bitmask keys exact in a float64


def set_key(members) -> int:
    """The bitmask of `members` (bool per worker)."""
    return sum(1 << i for i, m in enumerate(np.asarray(members, dtype=bool).ravel().tolist()) if m)


def key_members(key: int, n: int) -> np.ndarray:
    """The bool mask of the set `key` among `n` workers."""
    return np.array([(key >> i) & 1 == 1 for i in range(n)], dtype=bool)


class SetTimes:
    """This worker's step periods by set (`record`, reported by `mine`) and every
    worker's agreed record of the sets' step times (`receive`, `time`, `better`)."""

    def __init__(self, workers: int, window: int):
        self.n = workers
        self.window = window
        self.timed = workers <= MAX_WORKERS
        self._last_key = -1  # the set of this worker's step before (a change is not timed)
        self._mine: list[float] = []  # periods since the last report, of set `_mine_key`
        self._mine_key = -1
        self._hist: dict[int, list[tuple[int, float]]] = {}  # set -> [(step, seconds)], agreed
        self._keys: dict[bytes, int] = {}  # a set's mask (bytes) -> its key
        self._skip: set[int] = set()  # sets whose next report is of their split before (`moved`)
        self.version = 0  # changes whenever the agreed record may have (`receive`, `forget`)

    def record(self, members, seconds: float, counted: bool = True) -> None:
        """This worker's step just done took `seconds` from its start to the next step's,
        among the workers `members` (bool per worker; this worker one of them); `counted`
        False for a step that says nothing of its set (a probe, a partial batch)."""
        raw = np.asarray(members, dtype=bool).tobytes()
        key = self._keys.get(raw)
        if key is None:  # a step's set is known by its bytes after the first time (no loop per step)
            key = self._keys[raw] = set_key(members)
        changed, self._last_key = key != self._last_key, key
        if not self.timed or not counted or changed or not math.isfinite(seconds) or seconds <= 0:
            return
        if key != self._mine_key:
            self._mine, self._mine_key = [], key
        self._mine.append(float(seconds))

    def mine(self) -> tuple[float, float]:
        """(set key, median seconds) of this worker's timed steps since the last report,
        for the row it sends now; NaNs where none."""
        out = (float(self._mine_key), float(np.median(self._mine))) if self._mine else (math.nan, math.nan)
        self._mine = []
        return out

    def receive(self, keys, seconds, step: int) -> None:
        """Every worker's `mine` of one exchange of rows, at the balancer's `step`: each
        set reported gets the median of its members' numbers."""
        self.version += 1
        keys = np.asarray(keys, dtype=float)
        seconds = np.asarray(seconds, dtype=float)
        good = np.isfinite(keys) & np.isfinite(seconds) & (seconds > 0)
        for key in set(keys[good].astype(np.int64).tolist()):
            if key in self._skip:  # its steps before the split moved (`moved`)
                self._skip.discard(key)
                continue
            value = float(np.median(seconds[good & (keys == key)]))
            self._hist[key] = [*self._hist.get(key, [])[1 - self.window:], (int(step), value)]
        for key in [k for k, h in self._hist.items() if h[-1][0] < step - FRESH]:
            del self._hist[key]  # stale: priced by prediction again

    def moved(self, members) -> None:
        """The set `members` (bool per worker) goes on at another split: its times so far
        (the steps before the shares settled, say) are dropped, and so is its next report,
        sent before the new split took effect (each exchange's rows arrive one exchange
        later). Every worker calls it at the same point of the same sequence of rows
        applied, so all keep the same record."""
        self.version += 1
        key = set_key(members)
        self._hist.pop(key, None)
        self._skip.add(key)

    def forget(self, workers) -> None:
        """Drop the times of every set with one of `workers` (bool per worker) in it: a
        probe measures them afresh (a stall ended, a neighbour left), and the sets they
        would rejoin are priced by prediction again, and tried where it says so."""
        self.version += 1
        mask = set_key(workers)
        for key in [k for k in self._hist if k & mask]:
            del self._hist[key]

    def _recent(self, key: int, step: int) -> list[float]:
        return [v for s, v in self._hist.get(key, []) if s >= step - FRESH]

    def time(self, members, step: int) -> float:
        """The set's measured step seconds (median of its recent reports), NaN where it
        has fewer than `MEASURED_AFTER` within `FRESH` steps of `step`."""
        v = self._recent(set_key(members), step)
        return float(np.median(v)) if len(v) >= MEASURED_AFTER else math.nan

    def _error(self, values: list[float]) -> float:
        """Standard error of the median of `values` (1.25 x the MAD-based deviation / sqrt(k))."""
        v = np.asarray(values)
        return 1.2533 * 1.4826 * float(np.median(np.abs(v - np.median(v)))) / math.sqrt(len(v))

    def better(self, members, step: int) -> np.ndarray | None:
        """The set (bool mask) measured fastest among those measured recently, where it
        beats the set `members`, also measured, by more than `MARGIN` and `NOISE`
        standard errors; None where `members` was not measured (predict, and try it) or
        nothing beats it."""
        if not self.timed:
            return None
        mine = self._recent(set_key(members), step)
        if len(mine) < MEASURED_AFTER:
            return None
        t_mine, best, best_key = float(np.median(mine)), math.inf, None
        for key in self._hist:
            v = self._recent(key, step)
            if key == set_key(members) or len(v) < MEASURED_AFTER:
                continue
            t = float(np.median(v))
            noise = NOISE * math.hypot(self._error(v), self._error(mine))
            if t < min(t_mine * (1 - MARGIN), t_mine - noise) and t < best:
                best, best_key = t, key
        return None if best_key is None else key_members(best_key, self.n)


class SetPeriods:
    """A worker's steps from one start to the next, handed to `record` (the balancer's
    `record_period`) with the set each ran among: called at every step's start."""

    def __init__(self, workers: int, record: Callable[[np.ndarray, float, bool], None]):
        self.n = workers
        self.record = record
        self._open: tuple[np.ndarray, bool, float] | None = None  # (set, timed, start) of the step before
        self._masks: dict[tuple, np.ndarray] = {}

    def begin(self, now: float, samples: int, members, counted: bool) -> None:
        """A step starts at `now` among the workers `members` (indices), this worker with
        `samples` in it: the step before ends here. `counted` False for a step that says
        nothing of its set (a probe step, a partial batch); a step this worker sat out is
        not its to time."""
        if self._open is not None:
            mask, timed, t0 = self._open
            self.record(mask, now - t0, timed)
        if samples <= 0:
            self._open = None
            return
        ranks = tuple(members or ())
        mask = self._masks.get(ranks)
        if mask is None:  # the same few sets step after step: made once each
            mask = self._masks[ranks] = np.zeros(self.n, dtype=bool)
            mask[list(ranks)] = True
        self._open = (mask, counted, now)
