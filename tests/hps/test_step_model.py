"""The step-time model (fixed + per-sample, fitted online) and the exact share solver."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import Bounds, LinearConstraint, milp

from hetrain.perf.stepfit import StepTimeModel
from hetrain.perf.steptime import BatchDoesNotFitError, predicted_times, solve_shares, spread
from hetrain.train.balance import BalanceConfig, Balancer, DeviceMemoryTooSmallError, memory_caps


def _milp_optimum(g, fixed, per, lo, caps) -> float:
    """min T s.t. fixed_i + per_i b_i <= T, sum b = g, lo <= b <= cap, b integer (HiGHS,
    no optimality gap). Times are scaled so the optimum is at least 1 (by the continuous
    bound without caps, sum_i (T - fixed_i) / per_i = g), so HiGHS's absolute 1e-6 gap and
    tolerances do not bite: scaled by the largest per_i * cap_i instead, an optimum of
    1e-4 s sat within the gap of an answer 0.7% worse, and the solver's better answer
    failed the comparison."""
    bound = (g + np.sum(fixed / per)) / np.sum(1.0 / per)
    scale = 1.0 / max(bound, 1e-12)
    fixed, per = fixed * scale, per * scale
    n = len(fixed)
    c = np.zeros(n + 1)
    c[-1] = 1.0
    rows = [np.concatenate([np.ones(n), [0.0]])]
    lb, ub = [g], [g]
    for i in range(n):
        r = np.zeros(n + 1)
        r[i], r[-1] = per[i], -1.0
        rows.append(r)
        lb.append(-np.inf)
        ub.append(-fixed[i])
    res = milp(c, constraints=LinearConstraint(np.array(rows), lb, ub),
               integrality=np.concatenate([np.ones(n), [0]]),
               bounds=Bounds(np.concatenate([lo, [0]]), np.concatenate([caps, [np.inf]])),
               options={"mip_rel_gap": 0.0})
    assert res.success, res.message
    b = np.round(res.x[:n])
    return float(np.max(fixed + per * b)) / scale


@settings(max_examples=80, deadline=None)
@given(g=st.integers(1, 400), n=st.integers(1, 6), data=st.data())
def test_shares_sum_respect_caps_and_equalise_predicted_times(g, n, data):
    fixed = np.array(data.draw(st.lists(st.floats(0, 0.05), min_size=n, max_size=n)))
    per = np.array(data.draw(st.lists(st.floats(1e-6, 1e-2), min_size=n, max_size=n)))
    capf = data.draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n))
    caps = np.array([int(f * g) for f in capf], dtype=np.int64)
    min_samples = data.draw(st.integers(0, 3))
    if caps.sum() < g:
        with pytest.raises(BatchDoesNotFitError, match="does not fit"):
            solve_shares(g, fixed, per, caps, min_samples)
        return
    sizes = solve_shares(g, fixed, per, caps, min_samples)
    assert sizes.sum() == g
    assert np.all(sizes >= 0) and np.all(sizes <= caps)
    lo = np.minimum(caps, min_samples if g >= min_samples * n else 0)
    assert np.all(sizes >= lo)
    t = predicted_times(sizes, fixed, per)
    # every worker below its cap finishes within one of its own samples' time of the
    # slowest worker the solver gave samples beyond its minimum
    free = sizes > lo
    if free.any():
        top = t[free].max()
        below = sizes < caps
        assert np.all(t[below] + per[below] >= top - 1e-9), (sizes, t)
    # exact: the largest predicted time is the MILP optimum
    assert t.max() == pytest.approx(_milp_optimum(g, fixed, per, lo, caps), rel=1e-6, abs=1e-9)
    # deterministic: every worker computes the same answer from the same numbers
    assert np.array_equal(sizes, solve_shares(g, list(fixed), list(per), caps.copy(), min_samples))


def test_gpu_with_fixed_cost_and_fast_cpus():
    # a GPU worth 100 CPUs per sample but with 10 ms of fixed work per step
    fixed, per = [0.010, 0.0005, 0.0005], [1e-6, 1e-4, 1e-4]
    sizes = solve_shares(2048, fixed, per, [10**6] * 3)
    t = predicted_times(sizes, fixed, per)
    assert sizes.sum() == 2048 and sizes[0] > sizes[1] == sizes[2] > 0
    assert t.max() / t.min() < 1.01
    # proportional shares (speeds at one batch size) would overload the CPUs
    assert t.max() < predicted_times([2048 * 0.8, 2048 * 0.1, 2048 * 0.1], fixed, per).max()


def test_uncapped_worker_does_not_wrap():
    caps = memory_caps([float("inf"), 2**20, 0.0], BalanceConfig(memory_per_sample=2**14), 100)
    assert list(caps) == [100, 64, 0]
    assert list(memory_caps([float("inf")] * 2, BalanceConfig(), 7)) == [7, 7]
    assert solve_shares(100, [0, 0, 0], [1, 1, 1], caps).sum() == 100


def test_model_recovers_fixed_and_per_sample_through_noise_and_outliers():
    rng = np.random.default_rng(0)
    m = StepTimeModel(window=16, recent=3)
    for k in range(40):
        b = int(rng.integers(20, 80))
        t = 0.02 + 0.001 * b + rng.normal(0, 3e-4)
        if k % 7 == 3:
            t *= 3  # a step disturbed by another process
        m.add(b, t)
    fixed, per = m.fit()
    assert m.how == "regression"
    assert fixed == pytest.approx(0.02, abs=0.004)
    assert per == pytest.approx(0.001, rel=0.1)


def test_model_falls_back_when_batch_sizes_do_not_vary():
    m = StepTimeModel(window=8, recent=3)
    for _ in range(5):
        m.add(50, 0.07)
    assert m.fit() == pytest.approx((0.0, 0.0014)) and m.how == "proportional"
    for b in (20, 40, 60, 80):  # identifies fixed 0.02 s, 1 ms/sample
        m.add(b, 0.02 + 0.001 * b)
    assert m.fit() == pytest.approx((0.02, 0.001), abs=1e-9)
    for _ in range(8):  # balanced: one batch size again; the whole step gets 1.75x slower
        m.add(60, 1.75 * (0.02 + 0.001 * 60))
    fixed, per = m.fit()
    assert m.how == "held"
    assert fixed / per == pytest.approx(20.0)  # the identified shape is kept ...
    assert fixed + per * 60 == pytest.approx(0.14)  # ... at the current operating point


def test_speed_up_after_a_slowdown_does_not_overshoot():
    m = StepTimeModel(window=16, recent=3)
    for b in (40, 20, 60, 30, 50):
        m.add(b, 4 * (0.02 + 0.001 * b))  # slow: everything 4x
    for _ in range(3):
        m.add(10, 0.02 + 0.001 * 10)  # back to full speed at a small share
    fixed, per = m.fit()
    assert fixed + per * 10 == pytest.approx(0.03)  # passes through the operating point
    # at a larger next share it does not predict the worker faster than it is (which would
    # hand it too many samples: an overshoot); a held fixed part of the slow regime would
    # predict 0.039 s here against the true 0.06 s
    assert 0.06 * 0.95 <= fixed + per * 40 <= 0.06 * 1.5


def test_model_follows_a_speed_change_within_two_steps():
    m = StepTimeModel(window=16, recent=3)
    for _ in range(6):
        m.add(40, 0.04)
    m.add(40, 0.16)
    assert m.fit()[1] == pytest.approx(0.001)  # one slow step is an outlier
    m.add(40, 0.16)
    assert m.fit()[1] == pytest.approx(0.004)


def test_spread_ignores_empty_workers():
    assert spread([0.2, 0.1, 0.0], [5, 3, 0]) == pytest.approx(2.0)
    assert np.isnan(spread([0.0], [0]))


def _fake_gather(*calls):
    """Single process standing in for worker 0 of a two-worker job whose other worker
    reports calls[k] at the k-th exchange (the first one: its device and memory)."""
    seen = []

    def gather(row):
        other = np.asarray(calls[min(len(seen), len(calls) - 1)], dtype=float)
        other = np.r_[other, np.zeros(max(0, len(row) - len(other)))]  # (fixed, per): no noise, no metrics
        seen.append(row)
        rows = np.vstack([row, other])
        return lambda: rows
    return gather


def test_gpu_without_room_for_the_smallest_share_is_a_clear_error():
    # worker 1 reports a GPU (cuda flag, index 0) with 1 MiB free
    gpu_row = [2**20, 1, 1.0, 0.0, 1.0]
    cfg = BalanceConfig(memory_per_sample=2**20, reserved_bytes=2**19)
    with pytest.raises(DeviceMemoryTooSmallError, match=r"worker g0 \(cuda:0\): its GPU has 1\.0 MiB free \(cuda\).*"
                                                       r"needs 1\.5 MiB.*nvidia-smi"):
        Balancer(None, 64, cfg, memory=[2**30, 0], gather=_fake_gather(gpu_row), num_workers=2,
                 labels=["c0", "g0"])
    # with room it balances, and the caps come from the reported memory
    gpu_row[0] = 8 * 2**20
    b = Balancer(None, 64, cfg, memory=[2**30, 0], gather=_fake_gather(gpu_row), num_workers=2, labels=["c0", "g0"])
    assert list(b.caps) == [64, 7] and b.devices[1].cuda and b.devices[1].source == "cuda"
    assert b.sizes.sum() == 64 and b.sizes[1] <= 7


def test_balancer_rebalances_from_fits():
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.004]), num_workers=2)
    assert list(b.sizes) == [50, 50]
    b.record(50, 0.1)  # this worker: 2 ms per sample; the other reports fixed 0, 4 ms per sample
    b.update()
    assert list(b.sizes) == [67, 33]


def test_overlapped_exchange_applies_one_step_later():
    # the other worker's row: fixed, per sample, level error, exchange seconds with every worker
    # and in a smaller set (neither measured), one metric
    b = Balancer(None, 100, BalanceConfig(every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.004, 0.0, np.nan, np.nan, 50]), num_workers=2)
    b.record(50, 0.1)
    b.update(extra=(50,))
    assert list(b.sizes) == [50, 50] and b.rows is None  # the exchange is still in flight
    b.record(50, 0.1)
    b.update(extra=(50,))
    assert list(b.sizes) == [67, 33] and b.rows_step == 1  # step 1's fits, applied at step 2
    b.record(67, 0.134)
    b.update(extra=(67,))
    assert b.flush() is not None and b.rows_step == 3 and b.flush() is None


def _greedy_shares(g, fixed, per, caps, min_samples):
    """The definition the solver must meet exactly: from each worker's minimum, hand out
    the samples one at a time to the worker that would finish soonest with one more
    (ties: lower rank). O(global batch)."""
    n = len(fixed)
    caps = np.minimum(np.asarray(caps), g)
    sizes = np.minimum(caps, min_samples if g >= min_samples * n else 0).astype(np.int64)
    fixed = np.where(np.asarray(fixed) > 0, fixed, 0.0)
    for _ in range(g - int(sizes.sum())):
        t = np.where(sizes < caps, fixed + per * (sizes + 1), np.inf)
        sizes[int(np.argmin(t))] += 1
    return sizes


@settings(max_examples=200, deadline=None)
@given(g=st.integers(1, 600), n=st.integers(1, 6), ties=st.booleans(), data=st.data())
def test_shares_are_the_greedy_ones_sample_for_sample(g, n, ties, data):
    """Not only the optimal step time: the very shares of the one-at-a-time greedy, ties
    included (workers of equal speed), so every worker derives the same split."""
    if ties:  # equal speeds and fixed parts on a coarse grid: many exact ties
        fixed = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.01, 0.02]), min_size=n, max_size=n)))
        per = np.array(data.draw(st.lists(st.sampled_from([1e-3, 2e-3]), min_size=n, max_size=n)))
    else:
        fixed = np.array(data.draw(st.lists(st.floats(0, 0.05), min_size=n, max_size=n)))
        per = np.array(data.draw(st.lists(st.floats(1e-6, 1e-2), min_size=n, max_size=n)))
    caps = np.array([int(f * g) for f in data.draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n))])
    min_samples = data.draw(st.integers(0, 3))
    if caps.sum() < g or np.minimum(caps, min_samples if g >= min_samples * n else 0).sum() >= g:
        return  # does not fit / forced minimums only: covered by the test above
    assert solve_shares(g, fixed, per, caps, min_samples).tolist() == _greedy_shares(g, fixed, per, caps,
                                                                                     min_samples).tolist()


@pytest.mark.parametrize("every", [1, 2])
def test_shares_solved_while_the_exchange_waits_are_the_shares_update_gives(every):
    """`prefetch` (the optimizer runs it while the step's last bucket is in flight)
    completes the exchange in flight and re-plans early; the next `update` then only posts
    its own fit. Shares, their history and the rows for the metrics are the same as
    without it, whichever steps it runs in."""
    other = [[np.inf, 5, 0, 0, 1]] + [[0.002 * (1 + k % 3), 0.0004, 0.0, -1.0] for k in range(30)]
    runs = []
    for prefetch_at in (set(), set(range(30)), {3, 4, 9, 17}):
        # hold_noise=0: these steps swing by design (to re-plan often), not as noise to ride out
        b = Balancer(None, 100, BalanceConfig(every=every, hold_noise=0.0), gather=_fake_gather(*other),
                     num_workers=2)
        rows, early = [], 0
        for step in range(20):
            b.record(int(b.sizes[0]), 0.001 + 0.0002 * b.sizes[0] * (1 + step % 4))
            if step in prefetch_at:
                before = b.sizes.tolist()
                b.prefetch()
                early += b.sizes.tolist() != before  # re-planned here, ahead of update
            b.update(extra=(float(step),))
            rows.append(None if b.rows is None else b.rows.tolist())
        b.prefetch()
        last = b.flush()
        runs.append(([h.tolist() for h in b.history], rows, None if last is None else last.tolist()))
        assert early > 0 or not prefetch_at
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(h) for h in runs[0][0]}) > 2  # the shares did move


def test_an_epochs_last_batch_is_planned_once_per_fit():
    """The loader asks for the split of an epoch's last, smaller batch every epoch: it is
    solved once for the fits in force, and again only when new fits arrive."""
    b = Balancer(None, 100, BalanceConfig(overlap_exchange=False, every=1),
                 gather=_fake_gather([np.inf, 5, 0, 0, 1], [0.0, 0.002], [0.0, 0.003]), num_workers=2)
    b.record(50, 0.05)
    b.update()
    first = b.plan_for(37)
    assert b.plan_for(37) is first and first.sizes.sum() == 37
    b.record(60, 0.05)
    b.update()  # new fits: planned afresh
    again = b.plan_for(37)
    assert again is not first and again.sizes.sum() == 37


def test_level_spans_the_steps_since_the_speed_last_changed():
    """While the speed holds, the level is the median of the whole window, so its error
    shrinks with it; a change cuts it back to the steps after the change, and the
    regression never mixes the two speeds."""
    rng = np.random.default_rng(7)
    m = StepTimeModel(window=16, recent=5)
    sizes = [300, 340, 380] * 8
    for k, b in enumerate(sizes[:16]):
        m.add(b, (1e-3 + 1e-4 * b) * (1 + 0.05 * rng.standard_normal()))
        m.fit()
    assert m.span == 16 and m.level_error == pytest.approx(1.2533 * m.noise / 4)
    fixed, per = m.fit()
    assert fixed == pytest.approx(1e-3, abs=3e-3) and per == pytest.approx(1e-4, rel=0.15)
    for b in [340] * 4:  # 4x slower from here, at one batch size
        m.add(b, 4 * (1e-3 + 1e-4 * b) * (1 + 0.05 * rng.standard_normal()))
        m.fit()
    fixed, per = m.fit()
    assert m.span == 5 and m.since <= 5
    assert fixed + per * 340 == pytest.approx(4 * (1e-3 + 1e-4 * 340), rel=0.1)  # the new level
    for b in [170, 150, 190, 170, 160, 180]:  # the new shares vary: the new speed's own shape
        m.add(b, 4 * (1e-3 + 1e-4 * b) * (1 + 0.05 * rng.standard_normal()))
        fixed, per = m.fit()
        assert 0 <= fixed < 0.05 and per > 2e-4, (fixed, per)  # never a line through both speeds
    assert per == pytest.approx(4e-4, rel=0.25)


def test_a_worker_turning_4x_slower_keeps_its_share_of_the_step():
    """Two real balancers in lockstep (one process): worker 0 turns 4x slower while the
    shares are settled. Its share follows to the new best (a third here) within a few
    steps, and is never zero: a regression over both speeds once read it as 0.14 s of
    fixed time a pass, too slow to help, and a worker that sits out is never measured
    again."""
    from hetrain.train.exchange import InProcessExchange

    fixed, per = np.array([1e-3, 0.7e-3]), np.array([0.109e-3, 0.216e-3])
    ex = InProcessExchange(2)
    bal = [Balancer(None, 512, BalanceConfig(), gather=ex.gather_for(r), num_workers=2) for r in range(2)]
    rng = np.random.default_rng(3)
    seen = []
    for step in range(100):
        sizes = bal[0].sizes.copy()
        slow = per * np.array([4.0 if step >= 50 else 1.0, 1.0])
        times = (fixed + slow * sizes) * (1 + 0.03 * rng.standard_normal(2))
        for r, b in enumerate(bal):
            b.record(int(sizes[r]), float(times[r]))
        for b in bal:
            b.update()
        assert bal[0].sizes.tolist() == bal[1].sizes.tolist()
        seen.append(int(sizes[0]))
    assert abs(seen[49] - 341) <= 12, seen[40:50]  # settled at the first speeds
    assert min(seen[50:]) > 120 and all(abs(s - 169) <= 12 for s in seen[62:]), seen[50:]


def test_in_process_exchange_says_who_has_not_started():
    from hetrain.train.exchange import InProcessExchange

    ex = InProcessExchange(2)
    g0, g1 = ex.gather_for(0), ex.gather_for(1)
    assert g0(np.ones(2))().shape == (2, 2)  # the first (devices) is answered at once
    g1(np.ones(2))
    wait = g0(np.array([1.0, 2.0]))
    with pytest.raises(RuntimeError, match=r"worker\(s\) \[1\] had not started"):
        wait()
    g1(np.array([3.0, 4.0]))
    assert wait().tolist() == [[1.0, 2.0], [3.0, 4.0]]
