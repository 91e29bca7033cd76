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
from tests.hps.test_step_model import _fake_gather

NAN = float("nan")


def test_exchange_cost_is_the_least_measured_among_the_members():
    comm = [0.004, 0.002, NAN]
    assert exchange_cost([True, False, False], comm) == 0.0  # one worker alone exchanges nothing
    assert exchange_cost([True, True, False], comm) == 0.002  # the member that computed longest waited least
    assert exchange_cost([True, False, True], comm) == 0.004  # a member not measured: the others' number
    assert exchange_cost([False, False, True, True], [0.003, NAN, NAN, NAN]) == 0.003  # none measured among them
    assert exchange_cost([True, True], [NAN, NAN]) == 0.0 and not priced([NAN, 0.0]) and priced([NAN, 0.1])


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


def _two_workers(comm_other: float, comm_mine: float) -> Balancer:
    """This worker and another of the same speed (1 ms per sample), each measuring its
    exchange: the fits and exchange numbers of one re-balance."""
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.001, 0.0, comm_other]), num_workers=2)
    b.record(50, 0.05)
    b.record_exchange(comm_mine)
    b.update()
    return b


def test_a_worker_joins_only_where_the_step_with_its_exchange_is_faster():
    # sharing halves the compute (0.1 s alone, 0.05 s together): worth an exchange of 10 ms
    assert list(_two_workers(0.010, 0.012).sizes) == [50, 50]
    # not one of 80 ms: the fastest worker alone (the lower rank on a tie) takes the batch
    b = _two_workers(0.080, 0.090)
    assert list(b.sizes) == [100, 0] and b.prices.comm.tolist() == [0.090, 0.080]
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
    for _ in range(4):
        for r, b in enumerate(bal):
            share = max(1, int(b.sizes[r]))
            b.record(share, fixed[r] + per[r] * share)
            b.record(share + 8, fixed[r] + per[r] * (share + 8))
            b.record_exchange(comm[r])
            b.update()
    assert all(np.array_equal(b.sizes, bal[0].sizes) for b in bal)
    b = bal[0]
    f, p = b.fits[:, 0], b.fits[:, 1]
    chosen = plan_time(b.plan, f, p) + exchange_cost(b.plan.sizes > 0, b.prices.comm)
    solo = min(t for t in solo_times(batch, f, p) if math.isfinite(t))
    assert chosen <= solo * (1 + b.hold) + 1e-9, (b.plan, solo)
    from hetrain.perf.steptime import plan_unequal

    everyone = plan_unequal(batch, f, p, b.caps, drop=False)
    assert chosen <= (everyone.predicted + exchange_cost(everyone.sizes > 0, b.prices.comm)) * (1 + b.hold) + 1e-9


def test_leaving_beats_the_fixed_hold_and_rejoining_the_noise():
    """On noisy fits (the other worker's level error 0.5: a new split must be predicted 2x
    faster, `Balancer.hold`) a set that saves an exchange is still taken at once, as it
    beats `BalanceConfig.hold` (1%); taking the worker back needs to beat the noise."""
    rows = [[0.0, 0.001, 0.5, 0.010], [0.0, 0.001, 0.5, 0.080], [0.0, 0.001, 0.5, 0.001]]
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], *rows), num_workers=2)
    b.record(50, 0.05)
    b.record_exchange(0.012)
    b.update()
    assert list(b.sizes) == [50, 50] and b.hold == pytest.approx(1.0)
    b.record(50, 0.05)
    for _ in range(2):
        b.record_exchange(0.09)
    b.update()  # together: 0.05 s + 80 ms exchange; alone: 0.1 s
    assert list(b.sizes) == [100, 0]
    b.record(100, 0.1)
    b.update()  # the exchange now measured at 1 ms: together predicted 0.051 s, not 2x faster
    assert list(b.sizes) == [100, 0]
