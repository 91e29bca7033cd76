"""A worker sitting steps out keeps to half the trainers' measured pace (train/pace.py):
when it waits, how long, and when it must not."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hetrain.train.pace import CHUNK as DEFAULT_CHUNK, PACE, SitOutPace

CHUNK = 4  # the tests' chunk (waits every 4 steps sat out); the default is DEFAULT_CHUNK
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


def make(times: SetTimes, chunk: int = 4):
    clock = FakeClock()
    return SitOutPace(times, clock=clock, sleep=clock.sleep, chunk=chunk), clock


def measured(step_s: float, members=(0,), n: int = 3) -> SetTimes:
    """A record where the set `members` measured `step_s` a step, as the balancer's rows give it."""
    times = SetTimes(n, window=16)
    key = sum(1 << m for m in members)
    times.receive([key] * n, [step_s] * n, step=10)
    return times


def test_a_worker_out_waits_once_every_chunk_for_half_the_trainers_step_per_step():
    pace, clock = make(measured(0.004))
    for step in range(11, 11 + CHUNK):  # a chunk of steps sat out: no wait inside it
        assert pace.begin(True, [0], step) == 0.0
        clock.now += 0.0003  # its own loop: 0.3 ms a step
    owed = CHUNK * PACE * 0.004 - CHUNK * 0.0003
    assert pace.begin(True, [0], 11 + CHUNK) == pytest.approx(owed)  # the next step waits for all of them
    assert clock.sleeps == [pytest.approx(owed)]
    assert clock.now == pytest.approx(100.0 + CHUNK * PACE * 0.004)  # start to start: PACE x their step each
    for step in range(12 + CHUNK, 11 + 2 * CHUNK):
        clock.now += 0.0003
        assert pace.begin(True, [0], step) == 0.0
    clock.now += 0.0003
    pace.begin(True, [0], 11 + 2 * CHUNK)
    assert clock.now == pytest.approx(100.0 + 2 * CHUNK * PACE * 0.004)
    assert len(clock.sleeps) == 2 and pace.slept == pytest.approx(sum(clock.sleeps))


def test_no_wait_where_it_trains_where_the_set_is_unmeasured_or_its_loop_is_slower():
    pace, clock = make(measured(0.004))
    for step in range(11, 11 + 3 * CHUNK):
        clock.now += 0.0001
        assert pace.begin(False, [0, 1], step) == 0.0  # it trains (or times copies): never held
    for step in range(20, 20 + 3 * CHUNK):
        clock.now += 0.0001
        assert pace.begin(True, [0, 2], step) == 0.0  # the set {0, 2} never measured: no pace to keep
    for step in range(40, 40 + 3 * CHUNK):
        clock.now += 0.003  # its loop takes longer than half their step
        assert pace.begin(True, [0], step) == 0.0
    short, short_clock = make(measured(0.0015))  # half their step under MIN_WAIT: a wait costs more than it spreads
    for step in range(11, 11 + 3 * CHUNK):
        short_clock.now += 0.0001
        assert short.begin(True, [0], step) == 0.0
    assert short_clock.sleeps == []
    assert clock.sleeps == []
    # a step it trains in starts the count again: a chunk is steps sat out in a row
    for step in range(60, 60 + 2 * CHUNK):
        assert pace.begin(step % CHUNK != 0, [0], step) == 0.0
    assert clock.sleeps == []


def test_the_pace_follows_the_agreed_record_and_is_looked_up_once_per_change():
    times = measured(0.004)
    calls = []
    time_of = times.time

    def set_time(mask, step):
        calls.append(np.flatnonzero(mask).tolist())
        return time_of(mask, step)

    times.time = set_time  # counts the lookups
    clock = FakeClock()
    pace = SitOutPace(times, clock=clock, sleep=clock.sleep, chunk=1)
    for step in range(11, 20):
        pace.begin(True, [0], step)
    assert calls == [[0]]  # nine steps, one lookup
    times.receive([1, 1, 1], [0.010, 0.010, 0.010], step=20)  # a slower step measured for {0}
    pace.begin(True, [0], 21)
    assert calls == [[0], [0]]
    assert clock.sleeps[-1] == pytest.approx(PACE * times.time(np.array([True, False, False]), 21))
    times.forget(np.array([True, False, False]))  # a probe measures worker 0 afresh: no pace until measured
    before = len(clock.sleeps)
    for step in range(22, 26):
        clock.now += 0.0001
        assert pace.begin(True, [0], step) == 0.0
    assert len(clock.sleeps) == before and math.isnan(pace.period([0], 26))


def test_by_default_the_wait_comes_every_default_chunk_of_steps_sat_out():
    pace, clock = make(measured(0.004), chunk=DEFAULT_CHUNK)
    for step in range(11, 12 + 3 * DEFAULT_CHUNK):
        pace.begin(True, [0], step)
        clock.now += 0.0003
    assert len(clock.sleeps) == 3
    assert clock.now == pytest.approx(100.0 + 3 * DEFAULT_CHUNK * PACE * 0.004 + 0.0003)
