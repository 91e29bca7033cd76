"""Job lengths learned from finished jobs: Kaplan-Meier, the mean residual length, and
what the goodput policy is told (never a running job's true length)."""
import numpy as np
import pytest

from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.lengths import LengthModel, kaplan_meier, mean_residual, work_unit
from hetrain.sched.patterns import make_pattern
from hetrain.sched.simulator import simulate


def brute_mean_residual(a: float, sizes: np.ndarray, probs: np.ndarray) -> float:
    """E[S - a | S > a] by direct summation (probabilities given, no leftover mass)."""
    keep = sizes > a
    return float((probs[keep] * (sizes[keep] - a)).sum() / probs[keep].sum())


def test_kaplan_meier_without_censoring_is_the_empirical_distribution():
    pts, mass = kaplan_meier(np.array([3.0, 1.0, 2.0, 2.0]), np.zeros(0))
    assert pts.tolist() == [1.0, 2.0, 2.0, 3.0]
    assert mass.tolist() == pytest.approx([0.25, 0.25, 0.25, 0.25])


def test_kaplan_meier_with_censoring_by_hand():
    # events 1, 3; censored at 2 (and at 4: outlives every event). S(1) = 3/4;
    # at 3 two are at risk (3 and the censored 4): S(3) = 3/4 * 1/2; 3/8 left beyond 3
    pts, mass = kaplan_meier(np.array([1.0, 3.0]), np.array([2.0, 4.0]))
    assert pts.tolist() == [1.0, 3.0]
    assert mass.tolist() == pytest.approx([0.25, 0.375])


def test_mean_residual_of_a_certain_size_is_the_true_remaining():
    eff = mean_residual(np.array([0.0, 1.5, 4.9]), np.array([5.0]), np.array([1.0]))
    assert eff.tolist() == pytest.approx([5.0, 3.5, 0.1])
    # past every point with no leftover mass the distribution says nothing: NaN (prior rule)
    assert np.isnan(mean_residual(np.array([6.0]), np.array([5.0]), np.array([1.0]))).all()
    # leftover mass (censored jobs outlived every finished one) sits at twice the larger of
    # the last point and the attained service: a = 6 -> (2 x 6 - 6)
    assert mean_residual(np.array([6.0]), np.array([5.0]), np.array([0.5])).tolist() == pytest.approx([6.0])
    # a = 1: half the mass at 5 (4 left), half at 10 (9 left)
    assert mean_residual(np.array([1.0]), np.array([5.0]), np.array([0.5])).tolist() == pytest.approx([6.5])


@pytest.mark.parametrize("seed", range(5))
def test_mean_residual_by_direct_summation(seed):
    rng = np.random.default_rng(seed)
    sizes = np.sort(rng.uniform(0.1, 10.0, 12))
    probs = rng.uniform(0.1, 1.0, 12)
    probs /= probs.sum()
    att = np.array([0.0, float(sizes[3]), float(sizes[7]) + 1e-3])
    eff = mean_residual(att, sizes, probs)
    assert eff.tolist() == pytest.approx([brute_mean_residual(a, sizes, probs) for a in att], rel=1e-9)


def test_light_tails_favour_old_jobs_and_heavy_tails_young_ones():
    rng = np.random.default_rng(0)
    uniform = np.sort(rng.uniform(0.9, 1.1, 400))  # sizes nearly certain: an older job is nearly done
    eff = mean_residual(np.array([0.0, 0.5, 0.95]), uniform, np.full(400, 1 / 400))
    assert eff[0] > eff[1] > eff[2]
    pareto = np.sort(rng.pareto(1.2, 4000) + 1.0)   # heavy tail: the longer it ran, the longer it will
    eff = mean_residual(np.array([1.0, 5.0, 20.0]), pareto, np.full(4000, 1 / 4000))
    assert eff[0] < eff[1] < eff[2]


def test_the_policy_learns_only_from_jobs_that_finished():
    cluster = parse_cluster_spec("v100:2,p100:2")
    jobs = make_pattern("all-at-once-short", 12, cluster, seed=1)
    model = LengthModel(min_finished=3)
    for j in jobs:
        j.attained, j.remaining = 0.0, 1.0  # the simulator's prior for every job (lengths unknown)
    model.observe(jobs)
    assert model.remaining(jobs).tolist() == [1.0] * 12  # nothing finished: the prior stands
    for j in jobs[:4]:
        j.attained = j.work  # these finished
    for j in jobs[4:6]:
        j.attained = 0.5 * j.work  # running
    model.observe(jobs[4:])
    assert sorted(model.finished) == pytest.approx(sorted(j.work / work_unit(j) for j in jobs[:4]))
    rem = model.remaining(jobs[4:])
    assert np.all(rem > 0) and not np.allclose(rem, 1.0)
    told = jobs[6]
    told.length_known, told.remaining = True, 123.0
    assert model.remaining([told]).tolist() == [123.0]  # a told length is used as it is


def test_simulated_goodput_is_deterministic_and_starts_fresh_each_run():
    cluster = parse_cluster_spec("v100:4,p100:4,k80:4")
    a = simulate(make_pattern("poisson", 24, cluster, seed=3), cluster, "goodput")
    b = simulate(make_pattern("poisson", 24, cluster, seed=3), cluster, "goodput")
    assert a.avg_jct_s == b.avg_jct_s  # nothing learned in the first run leaks into the second


def test_a_move_must_pay_its_restart_back_within_the_hold():
    from hetrain.sched.job import Alloc
    from hetrain.sched.policies.goodput import configurations

    cluster = parse_cluster_spec("v100:4,p100:4")
    job = make_pattern("all-at-once-long", 1, cluster, seed=0)[0]
    job.started = True
    now = {job.job_id: Alloc(1, 1)}  # running on one P100
    def value_of(cfg, t, n):
        return float(cfg.value[(cfg.type == t) & (cfg.n == n)][0])
    free = configurations([job], cluster, now)
    held = configurations([job], cluster, now, hold_s=60.0)
    def gain(cfg):  # a move to one V100 against staying on the P100
        return value_of(cfg, 0, 1) / value_of(cfg, 1, 1)
    # a move is charged more when allocations are expected to hold only a minute than when
    # it has the job's whole run to pay back its restart
    assert gain(held) < gain(free)
    # Pollux's re-allocation factor: a job that restarted often for its age stays put
    job.restarts = 50
    assert gain(configurations([job], cluster, now, now=job.arrival + 600.0)) < gain(free)


@pytest.mark.parametrize("tail", ["light", "heavy"])
def test_learned_lengths_order_the_jobs_by_the_tail(tail):
    """One GPU, two waiting jobs that have run before: one has done 1.5 h of work, one
    0.1 h. Past jobs took 2 h each (light tail): the older one is nearly done and gets
    the GPU. Past jobs' lengths spread from minutes to weeks (heavy tail): the one that
    has run long is likely to run much longer, and the younger one gets it."""
    from hetrain.perf.jobs import TableCurve
    from hetrain.sched.cluster import gpu_pools
    from hetrain.sched.job import make_job
    from hetrain.sched.policies.goodput import solve

    cluster = gpu_pools(("v100",), (1,))
    curve = TableCurve({"v100": {1: 1.0}})  # one work unit per second: sizes in seconds
    old, young = (make_job(i, f"j{i}", 0.0, 100 * 3600.0, curve, cluster) for i in range(2))
    old.attained, young.attained = 1.5 * 3600, 0.1 * 3600
    for j in (old, young):
        j.started, j.restarts = True, 0
        j.remaining = max(j.attained, 3600.0)  # the prior rule: as much again as done
    model = LengthModel(min_finished=3)
    rng = np.random.default_rng(0)
    model.finished = list(rng.uniform(1.9, 2.1, 50) * 3600 if tail == "light" else
                          (rng.pareto(0.8, 400) + 1.0) * 0.05 * 3600)
    rem = model.remaining([old, young])
    plan = solve([old, young], cluster, {}, remaining=rem)
    assert plan == {(old if tail == "light" else young).job_id: (0, 1)}
    # the prior rule alone (least attained service first) always picks the young one
    assert solve([old, young], cluster, {}) == {young.job_id: (0, 1)}
