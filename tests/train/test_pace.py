"""A worker sitting steps out keeps to half the trainers' measured pace (train/pace.py):
when it waits, how long, and when it must not."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hetrain.train.pace import PACE, SitOutPace
from hetrain.train.set_times import SetTimes


class FakeClock:
    """A clock that moves only when slept on or told to."""

    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def make(times: SetTimes, n: int = 3):
    clock = FakeClock()
    return SitOutPace(times.time, lambda: times.version, n, clock=clock, sleep=clock.sleep), clock


def measured(step_s: float, members=(0,), n: int = 3) -> SetTimes:
    """A record where the set `members` measured `step_s` a step, as the balancer's rows give it."""
    times = SetTimes(n, window=16)
    key = sum(1 << m for m in members)
    times.receive([key] * n, [step_s] * n, step=10)
    return times


def test_a_worker_out_waits_half_the_trainers_step_since_its_step_before():
    pace, clock = make(measured(0.004))
    assert pace.begin(True, [0], 11) == 0.0  # its first step: nothing to pace from
    clock.now += 0.0003  # its own loop: 0.3 ms
    waited = pace.begin(True, [0], 12)
    assert waited == pytest.approx(PACE * 0.004 - 0.0003)
    assert clock.sleeps == [pytest.approx(PACE * 0.004 - 0.0003)]
    clock.now += 0.0001
    pace.begin(True, [0], 13)  # start to start: PACE x the step again
    assert clock.now == pytest.approx(100.0 + 2 * PACE * 0.004)
    assert pace.slept == pytest.approx(sum(clock.sleeps))


def test_no_wait_where_it_trains_where_the_set_is_unmeasured_or_its_loop_is_slower():
    pace, clock = make(measured(0.004))
    pace.begin(False, [0, 1], 11)
    clock.now += 0.0001
    assert pace.begin(False, [0, 1], 12) == 0.0  # it trains (or times copies): never held
    clock.now += 0.0001
    assert pace.begin(True, [0, 2], 13) == 0.0  # the set {0, 2} never measured: no pace to keep
    clock.now += 0.003  # its loop took longer than half their step
    assert pace.begin(True, [0], 14) == 0.0
    assert clock.sleeps == []


def test_the_pace_follows_the_agreed_record_and_is_looked_up_once_per_change():
    times = measured(0.004)
    calls = []

    def set_time(mask, step):
        calls.append(np.flatnonzero(mask).tolist())
        return times.time(mask, step)

    clock = FakeClock()
    pace = SitOutPace(set_time, lambda: times.version, 3, clock=clock, sleep=clock.sleep)
    for step in range(11, 20):
        pace.begin(True, [0], step)
    assert calls == [[0]]  # nine steps, one lookup
    times.receive([1, 1, 1], [0.010, 0.010, 0.010], step=20)  # a slower step measured for {0}
    pace.begin(True, [0], 21)
    assert calls == [[0], [0]]
    assert clock.sleeps[-1] == pytest.approx(PACE * times.time(np.array([True, False, False]), 21))
    times.forget(np.array([True, False, False]))  # a probe measures worker 0 afresh: no pace until measured
    before = len(clock.sleeps)
    clock.now += 0.0001
    assert pace.begin(True, [0], 22) == 0.0 and len(clock.sleeps) == before
    assert math.isnan(pace.period([0], 22))
