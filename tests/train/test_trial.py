"""A set of several workers gives way, for a few steps, to a subset of it never measured
(hetrain.train.trial): the measurement the fits cannot make where workers slow each other.
Pure, in one process."""
import numpy as np

from hetrain.train.balance import BalanceConfig, Balancer
from hetrain.train.exchange import InProcessExchange
from hetrain.train.trial import SubsetTrial

from .lockstep import drive

PAIR, FIRST, SECOND = np.array([True, True]), np.array([True, False]), np.array([False, True])


def test_a_measured_set_gives_way_after_its_wait_until_the_subset_is_measured():
    trial = SubsetTrial(every=8, limit=20)
    seen: set[bytes] = {PAIR.tobytes()}
    measured = lambda m: m.tobytes() in seen  # noqa: E731
    assert not trial.due(0, PAIR, True)  # the wait starts
    assert trial.propose(4, PAIR, True, [FIRST], measured) is None
    assert trial.propose(8, PAIR, True, [FIRST], measured).tolist() == [True, False]
    assert trial.propose(10, PAIR, True, [FIRST], measured).tolist() == [True, False]  # until measured
    seen.add(FIRST.tobytes())
    assert trial.propose(12, PAIR, True, [FIRST], measured) is None  # over: the measurements decide
    assert trial.gap == 16  # and the next wait is twice as long
    assert not trial.due(20, PAIR, True)
    # every subset measured: no trial, the record decides (looked at again a wait later)
    assert trial.propose(28, PAIR, True, [FIRST], measured) is None and trial.active is None


def test_no_trial_for_one_worker_an_unmeasured_set_or_when_off_and_a_trial_ends_by_its_limit():
    measured = lambda m: bool((m == PAIR).all())  # noqa: E731
    trial = SubsetTrial(every=4, limit=6)
    assert all(trial.propose(s, FIRST, True, [FIRST], measured) is None for s in range(0, 20, 2))  # alone
    assert all(trial.propose(s, PAIR, False, [FIRST], measured) is None for s in range(0, 20, 2))  # unmeasured
    off = SubsetTrial(every=0, limit=6)
    assert all(off.propose(s, PAIR, True, [FIRST], measured) is None for s in range(0, 40, 2))
    trial.propose(20, PAIR, True, [SECOND, FIRST], measured)
    assert trial.propose(24, PAIR, True, [SECOND, FIRST], measured).tolist() == [False, True]  # the fastest first
    assert trial.propose(28, PAIR, True, [SECOND, FIRST], measured) is not None  # 4 steps in
    assert trial.propose(30, PAIR, True, [SECOND, FIRST], measured) is None  # never measured: over after 6 steps
    # another set in use starts the wait again
    three = SubsetTrial(every=4, limit=6)
    a, b = np.array([True, True, False]), np.array([False, True, True])
    every3 = lambda m: int(m.sum()) >= 2  # noqa: E731
    three.propose(0, a, True, [np.array([True, False, False])], every3)
    assert three.propose(3, b, True, [np.array([False, True, False])], every3) is None
    assert three.propose(6, b, True, [np.array([False, True, False])], every3) is None  # 3 steps of b, not 6
    assert three.propose(7, b, True, [np.array([False, True, False])], every3).tolist() == [False, True, False]


def _run(probe_every: int, steps: int = 240) -> list[list[int]]:
    """Two workers of one speed, 1 ms a sample alone, exchanging in 10 ms, driven in
    lockstep like BalancedBatchSampler drives them. Together they slow each other (one
    host's cores): 2.5 ms a sample each, which their fits take for their speed, so the
    fits predict one worker alone at 0.25 s against the pair's 0.135 s; alone it runs
    0.1 s. Returns the shares per step."""
    ex = InProcessExchange(2)
    bal = [Balancer(None, 100, BalanceConfig(every=1, probe_every=probe_every), gather=ex.gather_for(r),
                    num_workers=2) for r in range(2)]
    return drive(bal, steps, lambda step, sizes: (2.5e-3 if (sizes > 0).all() else 1e-3) * sizes)


def test_a_pair_slowed_by_sharing_cores_gives_way_to_one_worker_that_runs_faster_alone():
    """Without trials the pair stays: its fits, slowed by each other, predict either worker
    alone slower. With them (the probes' wait, 8 steps here) one worker is tried alone
    once the pair ran measured, measured faster, and kept for most of the run."""
    stuck = _run(probe_every=0)
    assert all(min(s) > 0 for s in stuck[20:]), stuck[20:40]
    shares = _run(probe_every=8)
    alone = [k for k, s in enumerate(shares) if min(s) == 0]
    assert alone and alone[0] < 40, shares[:40]
    assert len([k for k in alone if k >= 60]) >= 0.8 * (len(shares) - 60), shares[60:]


def test_a_trial_alone_reports_at_the_exchange_cadence_of_several_and_ends_within_a_few_steps():
    """Two workers of one speed that do not slow each other: the pair is right, and the
    trial of one worker alone loses. Alone, the balancer exchanges only every window (16
    steps); on trial it exchanges as a pair does (every 2), so the trial is measured
    and over within a few steps rather than a window or two of steps at the wrong split."""
    ex = InProcessExchange(2)
    bal = [Balancer(None, 100, BalanceConfig(probe_every=64), gather=ex.gather_for(r), num_workers=2)
           for r in range(2)]
    shares = drive(bal, 160, lambda step, sizes: 1e-3 * sizes, leave=True)
    alone = [min(s) == 0 for s in shares]
    runs, k = [], 0
    while k < len(alone):
        if alone[k]:
            j = k
            while j < len(alone) and alone[j]:
                j += 1
            runs.append(j - k)
            k = j
        else:
            k += 1
    assert runs, "no subset was ever tried"
    assert max(runs) <= 8, runs
