"""The Sia-formulation peer: its integer program's plan equals enumeration on small cases,
and the formulation's pieces (normalisation, restart factor, fairness exponent)."""
import numpy as np
import pytest

from hetrain.errors import UserError
from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.job import Alloc, use_goodput
from hetrain.sched.patterns import make_pattern
from hetrain.sched.policies import check_allocation, get_policy
from hetrain.sched.policies.mckp import DECOMPOSE_GAP, enumerate_plans
from hetrain.sched.policies.sia import restart_factor, sia_configurations, sia_policy
from hetrain.sched.simulator import simulate


def _plan(cfg, jobs, x):
    return {jobs[cfg.job[k]].job_id: Alloc(int(cfg.type[k]), int(cfg.n[k])) for k in np.flatnonzero(x)}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("p", [-0.5, 0.5])
def test_sia_plan_equals_enumeration(seed, p):
    rng = np.random.default_rng(seed)
    cluster = parse_cluster_spec(f"v100:{rng.integers(2, 5)},p100:{rng.integers(1, 4)},k80:{rng.integers(1, 3)}")
    jobs = make_pattern("all-at-once", int(rng.integers(3, 5)), cluster, seed=seed, elastic_max=4)
    use_goodput(jobs, True)
    # some jobs running (restart penalty in play), at various ages
    alloc = {}
    for j in jobs[: len(jobs) // 2]:
        j.started, j.restarts, j.arrival = True, int(rng.integers(0, 3)), -float(rng.uniform(0, 600))
        alloc[j.job_id] = Alloc(0, 1) if sum(a.n for a in alloc.values() if a.type == 0) < cluster.counts[0] else None
    alloc = {k: v for k, v in alloc.items() if v is not None}
    plan = sia_policy(p=p, gap=0.0)(jobs, cluster, alloc, 0.0)  # solved exactly
    near = sia_policy(p=p)(jobs, cluster, alloc, 0.0)           # the default certified gap
    check_allocation(jobs, cluster, plan)
    cfg = sia_configurations(jobs, cluster, alloc, 0.0, p)
    best, x = enumerate_plans(cfg, len(jobs), np.asarray(cluster.capacity))
    got = sum(float(cfg.value[np.flatnonzero((cfg.job == [j.job_id for j in jobs].index(jid)) &
                                             (cfg.type == a.type) & (cfg.n == a.n))[0]]) for jid, a in plan.items())
    assert got == pytest.approx(best, rel=1e-9)
    assert plan == _plan(cfg, jobs, x)
    check_allocation(jobs, cluster, near)
    near_val = sum(float(cfg.value[np.flatnonzero((cfg.job == [j.job_id for j in jobs].index(jid)) &
                                                  (cfg.type == a.type) & (cfg.n == a.n))[0]]) for jid, a in near.items())
    assert near_val >= best * (1 - DECOMPOSE_GAP) - 1e-12


def test_fairness_exponent_spreads_gpus_over_jobs():
    """p < 0 runs as many jobs as fit before speeding any up: 8 jobs on 8 GPUs get one each."""
    cluster = parse_cluster_spec("v100:8")
    jobs = make_pattern("all-at-once", 8, cluster, seed=3)
    use_goodput(jobs, True)
    plan = sia_policy(p=-0.5)(jobs, cluster, {}, 0.0)
    assert len(plan) == 8 and all(a.n == 1 for a in plan.values())


def test_restart_factor_follows_pollux():
    cluster = parse_cluster_spec("v100:4")
    job = make_pattern("all-at-once", 1, cluster, seed=0)[0]
    assert restart_factor(job, 100.0) == 1.0  # never ran: no penalty
    job.started, job.restart_cost, job.restarts = True, 10.0, 2
    assert restart_factor(job, 110.0) == pytest.approx((110 - 20) / (110 + 10))
    assert restart_factor(job, 5.0) == 0.0


def test_sia_runs_a_simulation_and_rejects_bad_knobs():
    cluster = parse_cluster_spec("v100:4,p100:4,k80:4")
    res = simulate(make_pattern("poisson", 20, cluster, seed=2), cluster, get_policy("sia"))
    assert np.all(np.isfinite(res.finish))
    with pytest.raises(UserError, match="non-zero"):
        sia_policy(p=0)
    with pytest.raises(UserError, match="lambda"):
        sia_policy(lam=0.5)
