"""The balancer's exchange of step-time fits: once every `exchange_every` steps each worker
sends its fit of this step's compute, its exchange seconds and any extra numbers, and on
receipt every worker re-plans the shares from the same rows (`train/exchange.py` moves
them: riding the optimizer's all-reduce, else an all-gather of their own). With
`overlap_exchange` the exchange completes during the next step. Mixed into
`balance.Balancer`, which plans the shares (`plan_for`) from what is applied here."""
from __future__ import annotations

import math
from functools import cached_property
from typing import Callable

import numpy as np

from .exchange import carried, exchange_rows, ready

# a row: fixed, per-sample, level error (the fit); whole, part (exchange seconds:
# train/exchange_price.py); set key, set seconds (train/set_times.py); then the extra numbers
ROW = 7

# steps between the metrics-only exchanges of a job where one worker trains alone (`solo`):
# a collective with workers that only sit out, rare enough that its cost (posting and
# completing gloo's all-gather took several milliseconds of the trainer's time on a loaded
# 2-core host, bench/loop_overhead.py) is a small part of any step
SOLO_EVERY = 64

# while one worker trains alone by speed, its exchanges come at most once per this many
# seconds of its predicted steps (in whole windows, doubled, up to SOLO_EVERY steps). An
# exchange costs every process a gather and a re-plan, the same whatever the step: at
# one a window, a job of 2 ms steps paid it every 32 ms, where a capped job pays its
# metrics-only one every 64 steps (docs/hps.md: the dry run of bench/hetero_real.py
# before and after). A lone worker's fit needs no more than a change of its speed
# reaching the shares within a fraction of a second.
ALONE_EXCHANGE_S = 0.1


class FitExchange:
    """Recording this worker's step and exchanging the fits with the other workers."""

    def record(self, samples: int, seconds: float) -> None:
        """This worker's compute for the step just done."""
        self.model.add(samples, seconds)

    def record_exchange(self, seconds: float, whole: bool = True) -> None:
        """This worker's exchange with the others in the step just done, every worker in
        it or not (`ExchangePrices.record`)."""
        self.prices.record(seconds, whole)

    def record_period(self, members, seconds: float, counted: bool = True) -> None:
        """This worker's step just done took `seconds` from its start to the next step's
        start, among the workers `members` (`SetTimes.record`)."""
        self.set_times.record(members, seconds, counted)

    def update(self, extra=(), alone: bool = False) -> np.ndarray:
        """Exchange this step's fit (and `extra` numbers) and recompute the shares: a
        collective over the workers, every `exchange_every` steps (after a step one worker
        trained `alone`, fewer: `_every`).

        With `overlap_exchange` (default) the exchange started here completes during the
        next step, and the shares computed now use the exchange of the step before: no
        worker waits for the others here, at the cost of shares one step older. `rows`
        then holds the extra numbers of that earlier step (`rows_step` says which), or
        None when no exchange has completed yet."""
        self.step += 1
        if not self.lockstep:
            fixed, per = self.model.fit()
            self.rows, self.rows_step = np.array([[*extra]], dtype=np.float64), self.step
            self.history.append(self.sizes.copy())
            return self.sizes
        early, self._prefetched = self._prefetched, False  # applied in the step's exchange already
        if self.step % self._every(alone) != 0:  # no exchange: complete the one in flight, if any
            if not early:
                self.rows = None
                if not alone:  # (after a step one worker trained alone: at the next exchange, see _every)
                    self._complete_pending()
            self.history.append(self.sizes.copy())
            return self.sizes
        fixed, per = self.model.fit()
        row = np.array([fixed, per, self.model.level_error, *self.prices.mine(), *self.set_times.mine(), *extra],
                       dtype=np.float64)
        # after a step one worker trained alone, the next is likely so too: no all-reduce of
        # the job's for the rows to ride, whose wait would then gather them, blocking
        wait = exchange_rows(row, self._gather, None if alone else self.carry)
        step = self.step
        if self.cfg.overlap_exchange:
            (wait, step), self._pending = (self._pending or (None, 0)), (wait, step)
        if not early:
            self.rows = None
        if wait is not None:
            self._receive(wait, step)
        # every worker has applied the same rows here, whether prefetched or not
        self._alone_every = self._alone_cadence()
        self.history.append(self.sizes.copy())
        return self.sizes

    def prefetch(self) -> None:
        """Complete the exchange in flight and solve the shares it gives now, ahead of the
        next `update` (the shares of the step after this one; no result of this step is
        needed). Called from the optimizer's exchange while it waits for the step's last
        bucket (`PushPull.while_waiting`), so the re-plan takes time the wait would idle
        rather than the critical path between steps (not where gloo's socket threads
        yield to this process: there the wait is theirs, runtime/commthreads.py). Same
        shares, same rows as `update` would give; does nothing without an exchange in
        flight."""
        if self.lockstep and self._pending is not None and not self._prefetched and ready(self._pending[0]):
            self._complete_pending()
            self._prefetched = True

    @property
    def exchange_every(self) -> int:
        """Steps between exchanges: `every`; `window` with equal shares (metrics only);
        `SOLO_EVERY` where one worker of several trains alone (`solo`: metrics only too).
        Every worker knows which from the agreed config and caps."""
        if self.solo and self.n > 1:
            return max(self.cfg.every, self.cfg.window, SOLO_EVERY)
        return max(self.cfg.every, self.cfg.window) if self.cfg.policy == "equal" else self.cfg.every

    def _every(self, alone: bool) -> int:
        """Steps between exchanges at the end of a step: `exchange_every`, or, after a step
        that one worker trained alone (`alone`: the step's agreed split gave every sample
        to one worker, which every worker knows alike, so all decide the same at the same
        step), the cadence `_alone_cadence` set at the last exchange. While the others sit
        out, their fits stand still (a probe, which trains them, is a step of several
        workers again), so an exchange would carry the one worker's fit, whose level
        follows `recent` steps anyway: a worker sitting out otherwise paid a collective of
        its own every `every` steps with the one training, and that one waited on it. The
        exchange in flight then completes at the next exchange (or after the next step of
        several workers), not the step after it began: no worker waits on it (on a loaded
        2-core host each wait took milliseconds, bench/loop_overhead.py). Not while a
        subset is on trial (train/trial.py, agreed like the split): its first report ends
        the trial, so a trial of one worker reporting every `window` steps or more would
        run a window or two of steps at a split the fits did not choose
        (`bench/plan.py --whole-job`'s 48-step runs then measured little but trials)."""
        every = self.exchange_every
        return max(every, self._alone_every) if alone and self.trial.active is None else every

    def _alone_cadence(self) -> int:
        """Steps between exchanges while one worker trains alone: `window`, doubled while
        that is under `ALONE_EXCHANGE_S` of the agreed plan's predicted step, up to
        `SOLO_EVERY` (never under `window`, the steps a fit is made of). Set at each
        exchange from the agreed plan, and held until the next one: every worker has the
        same. A change of the lone worker's speed reaches the shares up to two of these
        later."""
        k, step_s = self.cfg.window, self.plan.predicted if self.plan is not None else float("nan")
        if not (math.isfinite(step_s) and step_s > 0):
            return k
        most = max(self.cfg.window, SOLO_EVERY)
        while k < most and k * step_s < ALONE_EXCHANGE_S:
            k = min(2 * k, most)
        return k

    @cached_property
    def solo(self) -> bool:
        """Only one worker may take samples (the others capped at 0 by `max_samples` or
        their memory) and it can hold the whole batch: every split, whatever the fits,
        gives it every sample (one local batch, nothing to accumulate, no probe: a worker
        capped at 0 is never probed). The caps are agreed at the start, so every worker
        knows this alike. The exchange then carries the metrics only (`exchange_every`)
        and a received fit is not solved for (in a job of one worker too): a job whose GPU
        trains alone otherwise paid a collective with the workers sitting out every
        `every` steps, and waited on it, for nothing."""
        caps = np.asarray(self.caps)
        return int((caps > 0).sum()) == 1 and int(caps.max()) >= self.global_batch

    def flush(self) -> np.ndarray | None:
        """Complete the exchange still in flight (end of an epoch) and apply it; returns
        its extra numbers (None if there was none). A collective like `update`."""
        if self._prefetched:  # applied already, after the last update
            self._prefetched = False
            self.history[-1] = self.sizes.copy()
            return self.rows
        self.rows = None
        if self._complete_pending():
            self.history[-1] = self.sizes.copy()
        return self.rows

    def _complete_pending(self) -> bool:
        if self._pending is None:
            return False
        (wait, step), self._pending = self._pending, None
        self._receive(wait, step)
        return True

    def _receive(self, wait: Callable[[], np.ndarray], step: int) -> None:
        self.carried += carried(wait)
        self._apply(wait(), step)

    def _apply(self, rows: np.ndarray, step: int) -> None:
        self.rows, self.rows_step = rows[:, ROW:], step
        self.level_error = np.nan_to_num(rows[:, 2])
        self.prices.receive(rows[:, 3], rows[:, 4])
        self.set_times.receive(rows[:, 5], rows[:, 6], step)
        if self.cfg.policy == "equal" and np.array_equal(rows[:, :2], self.fits, equal_nan=True):
            return  # equal shares do not depend on the fits: nothing to solve
        self.fits = rows[:, :2].copy()
        if self.solo:  # one worker takes every sample whatever the fits: nothing to solve
            return
        self._partial.clear()
        before, self.plan = self.plan, self.plan_for(self.global_batch)
        self.sizes = self.plan.sizes
        if before is not None and _other_split(before.sizes, self.sizes):
            self.set_times.moved(self.sizes > 0)  # its time so far was another split's


def _other_split(before: np.ndarray, after: np.ndarray) -> bool:
    """The same workers (those with samples) at other shares."""
    return bool(((before > 0) == (after > 0)).all()) and not np.array_equal(before, after)
