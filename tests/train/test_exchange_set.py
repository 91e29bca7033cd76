"""Choosing who takes part once the gradient exchange is priced (hetrain.perf.exchangeset
and the balancer): the best subset of devices is always a candidate, so a job is never
predicted slower than it, and every worker agrees on the choice. Pure, in one process."""
import math

import numpy as np
import pytest

from hetrain.perf.exchangeset import exchange_cost, fastest_sets, price_floor, priced, solo_times
from hetrain.perf.steptime import plan_time, step_floor
from hetrain.train.balance import BalanceConfig, Balancer
from hetrain.train.exchange import InProcessExchange
from hetrain.train.exchange_price import PRICED_AFTER, ExchangePrices
from tests.hps.test_step_model import _fake_gather

NAN = float("nan")


def test_exchange_cost_is_the_least_measured_among_the_members():
    comm = [0.004, 0.002, NAN]
    assert exchange_cost([True, False, False], comm) == 0.0  # one worker alone exchanges nothing
    assert exchange_cost([True, True, False], comm) == 0.002  # the member that computed longest waited least
    assert exchange_cost([True, False, True], comm) == 0.004  # a member not measured: the others' number
    assert exchange_cost([False, False, True, True], [0.003, NAN, NAN, NAN]) == 0.003  # none measured among them
    assert exchange_cost([True, True], [NAN, NAN]) == 0.0 and not priced([NAN, 0.0]) and priced([NAN, 0.1])


def test_the_whole_job_and_a_smaller_set_are_priced_by_their_own_kind_of_exchange():
    """With summation servers every worker in means the servers' path, a smaller set an
    all-reduce among its members: each is priced by the numbers measured in its kind."""
    whole, part = [0.020, 0.020, 0.025], [0.001, 0.002, NAN]  # servers' path; all-reduce of workers 0 and 1
    assert exchange_cost([True] * 3, whole, part) == 0.020  # not the smaller sets' 1 ms
    assert exchange_cost([True, True, False], whole, part) == 0.001
    assert exchange_cost([False, True, True], whole, part) == 0.002
    # no smaller set measured yet: priced at the whole job's exchange (the path a set of several pays),
    # or where the workers share a host, by the cost model's all-reduce of its workers (then tried)
    assert exchange_cost([True, True, False], whole, [NAN] * 3) == 0.020
    assert exchange_cost([True, True, False], whole, [NAN] * 3, short=lambda k: 1e-4 * k) == pytest.approx(2e-4)
    assert exchange_cost([True, True, False], whole, part, short=lambda k: 1e-4 * k) == 0.001  # measured: that
    assert exchange_cost([True] * 3, whole, part, short=lambda k: 0.0) == 0.020
    assert exchange_cost([True] * 3, [NAN] * 3, part) == 0.001  # and the other way round
    assert exchange_cost([True, False, False], whole, part) == 0.0
    assert priced([NAN] * 3, part) and not priced([NAN] * 3, [NAN, 0.0, NAN])
    assert price_floor(100, [0.0] * 3, [1e-3] * 3, [100] * 3, whole, 0.03, part) == pytest.approx(0.031)


def test_fastest_sets_grow_by_solo_time_where_the_caps_hold_the_batch():
    fixed, per = [0.01, 0.0, 0.002], [1e-3, 1e-4, 2e-4]  # alone on 100 samples: 0.11, 0.01, 0.022 s
    assert solo_times(100, fixed, per) == pytest.approx([0.11, 0.01, 0.022])
    sets = fastest_sets(100, fixed, per, [100, 100, 100])
    assert [m.tolist() for m in sets] == [[False, True, False], [False, True, True]]
    # the fastest cannot hold the batch alone: the first candidate is the two fastest
    assert [m.tolist() for m in fastest_sets(100, fixed, per, [100, 60, 100])] == [[False, True, True]]
    # a bound no split beats: a worker alone, or the water level plus the least exchange
    floor = step_floor(100, fixed, per)
    assert price_floor(100, fixed, per, [100] * 3, [0.05, NAN, NAN], floor) == pytest.approx(0.01)
    assert price_floor(100, fixed, per, [100] * 3, [1e-4, NAN, NAN], floor) == pytest.approx(floor + 1e-4)


def _two_workers(comm_other: float, comm_mine: float, steps: int = PRICED_AFTER) -> Balancer:
    """This worker and another of the same speed (1 ms per sample), each measuring its
    exchange, for `steps` re-balances (the exchange is priced from the `PRICED_AFTER`-th)."""
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.001, 0.0, comm_other]), num_workers=2)
    for _ in range(steps):
        b.record(50, 0.05)
        b.record_exchange(comm_mine)
        b.update()
    return b


def test_a_worker_joins_only_where_the_step_with_its_exchange_is_faster():
    # sharing halves the compute (0.1 s alone, 0.05 s together): worth an exchange of 10 ms
    assert list(_two_workers(0.010, 0.012).sizes) == [50, 50]
    # not one of 80 ms: the fastest worker alone (the lower rank on a tie) takes the batch
    b = _two_workers(0.080, 0.090)
    # a step's exchange is the least its members measured (the one that reached it last waited least)
    assert list(b.sizes) == [100, 0] and b.prices.comm.tolist() == [0.080, 0.080]
    # not priced on fewer steps (a set's next exchanges still pay some of its start)
    assert list(_two_workers(0.080, 0.090, steps=PRICED_AFTER - 1).sizes) == [50, 50]
    # without the exchange priced (leave=False: every worker is in every exchange anyway)
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1, leave=False),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.001, 0.0, 0.08]), num_workers=2)
    b.record(50, 0.05)
    b.update()
    assert list(b.sizes) == [50, 50]


@pytest.mark.parametrize("seed", range(6))
def test_the_chosen_split_is_never_predicted_slower_than_the_best_subset(seed):
    """Random fits and exchange times for 4 workers, every worker's balancer driven in
    lockstep: all agree on the split, and its predicted step (compute + exchange) is within
    `hold` of the best of every worker alone and of the compute-optimal split of all."""
    rng = np.random.default_rng(seed)
    n, batch = 4, 256
    fixed = rng.uniform(0.0, 0.01, n)
    per = rng.choice([2e-6, 5e-5, 2e-4], n) * rng.uniform(0.8, 1.2, n)
    comm = rng.uniform(0.0005, 0.02, n)
    ex = InProcessExchange(n)
    bal = [Balancer(None, batch, BalanceConfig(every=1), gather=ex.gather_for(r), num_workers=n) for r in range(n)]
    for _ in range(PRICED_AFTER + 1):
        for r, b in enumerate(bal):
            share = max(1, int(b.sizes[r]))
            b.record(share, fixed[r] + per[r] * share)
            b.record(share + 8, fixed[r] + per[r] * (share + 8))
            b.record_exchange(comm[r])
            b.update()
    assert all(np.array_equal(b.sizes, bal[0].sizes) for b in bal)
    b = bal[0]
    f, p = b.fits[:, 0], b.fits[:, 1]
    assert b.prices.measured
    chosen = plan_time(b.plan, f, p) + exchange_cost(b.plan.sizes > 0, b.prices.comm, b.prices.part)
    solo = min(t for t in solo_times(batch, f, p) if math.isfinite(t))
    assert chosen <= solo * (1 + b.hold) + 1e-9, (b.plan, solo)
    from hetrain.perf.steptime import plan_unequal

    everyone = plan_unequal(batch, f, p, b.caps, drop=False)
    assert chosen <= (everyone.predicted + exchange_cost(everyone.sizes > 0, b.prices.comm, b.prices.part)) * (
        1 + b.hold) + 1e-9


def test_leaving_beats_the_fixed_hold_and_rejoining_the_noise():
    """On noisy fits (the other worker's level error 0.5: a new split must be predicted 2x
    faster, `Balancer.hold`) a set that saves an exchange is still taken at once, as it
    beats `BalanceConfig.hold` (1%); taking the worker back needs to beat the noise."""
    fast, slow, quick = [0.0, 0.001, 0.5, 0.010], [0.0, 0.001, 0.5, 0.080], [0.0, 0.001, 0.5, 0.001]
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], *[fast] * PRICED_AFTER, *[slow] * 5, quick),
                 num_workers=2)
    for _ in range(PRICED_AFTER):
        b.record(50, 0.05)
        b.record_exchange(0.012)
        b.update()
    assert list(b.sizes) == [50, 50] and b.hold == pytest.approx(1.0)
    for k in range(5):  # the exchange now takes 80 ms: once that is the median of its steps ...
        b.record(50, 0.05)
        b.record_exchange(0.09)
        b.update()
        assert list(b.sizes) == ([100, 0] if k == 4 else [50, 50])
    # ... together: 0.05 s + 80 ms; alone: 0.1 s
    for _ in range(12):
        b.record(100, 0.1)
        b.update()  # the other worker measures 1 ms (a probe's set, say): together 0.051 s, not 2x faster
    assert b.prices.comm[1] == pytest.approx(0.001) and list(b.sizes) == [100, 0]


@pytest.mark.parametrize("noisy", [False, True])
def test_leaving_needs_to_beat_the_noise_of_the_exchange_it_saves(noisy):
    """Together 0.05 s + an exchange of 55 ms (the median of its steps), alone 0.1 s: 5%
    faster alone. Measured steadily, the worker leaves (`BalanceConfig.hold`, 1%); measured
    40 and 70 ms in turn (a loaded host), the price's standard error (about 10 ms, twice
    that is a fifth of the step) says nothing of a 5% gain: it stays."""
    exchange = [0.040, 0.070] * 4 if noisy else [0.055] * 8
    rows = [[0.0, 0.001, 0.0, e] for e in exchange]
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], *rows), num_workers=2)
    for e in exchange:
        b.record(50, 0.05)
        b.record_exchange(e)
        b.update()
    assert b.prices.comm[0] == pytest.approx(0.055)
    assert list(b.sizes) == ([50, 50] if noisy else [100, 0])


def test_a_step_exchange_is_the_least_its_members_measured_and_its_kind_its_own():
    """Per step, the least number among the workers that measured one kind goes to each
    of them; a worker out of the step (NaN) keeps its own; the other kind is untouched."""
    p = ExchangePrices(3, window=8)
    for k in range(PRICED_AFTER):
        p.receive([0.030, 0.010 + k * 1e-3, 0.020], [NAN] * 3)
    assert p.comm.tolist() == pytest.approx([0.0115] * 3) and np.isnan(p.part).all()
    for _ in range(PRICED_AFTER):
        p.receive([NAN] * 3, [0.002, NAN, 0.003])
    assert p.part[0] == p.part[2] == pytest.approx(0.002) and np.isnan(p.part[1])
    p.record(0.5, whole=False)
    p.record(0.7, whole=False)
    whole, part = p.mine()
    assert np.isnan(whole) and part == pytest.approx(0.6)
    assert all(np.isnan(p.mine()))  # each number is reported once


def test_a_sets_first_exchange_and_a_step_alone_are_not_measured():
    """A set's first exchange makes its group, announces the layout, connects to the
    servers: not counted, nor a step this worker is out of or alone in; after it, every
    worker in is the whole job's kind and fewer a set short of it."""
    p = ExchangePrices(3, window=8)
    assert p.kind_of([0, 1, 2], 10) is None and p.kind_of([0, 1, 2], 10) is True
    assert p.kind_of([0, 1], 10) is None and p.kind_of([0, 1], 10) is False and p.kind_of([0, 1], 0) is None
    assert p.kind_of([0], 64) is None and p.kind_of([0], 64) is None
