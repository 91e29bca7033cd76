"""The yardstick: the seed's integer program solved exactly at every decision.

Same admission as doubling (so both size the same set of jobs), then choose for every
admitted job one (GPU type, count) with count in [min, max] to minimise the sum of
estimated completion times (restart cost charged on a change) subject to each pool's
capacity. It is a multiple-choice knapsack, solved as a MILP with SciPy's HiGHS.
`exhaustive` enumerates every choice instead (tests check the two agree).
Meant for small instances: it refuses more than MAX_JOBS admitted jobs.
"""
from __future__ import annotations

import itertools

import numpy as np

from ...errors import UserError
from ..job import Alloc
from ...quiet import quiet_stdout
from .base import admit_at_minimum, register

MAX_JOBS = 64


def _options(job, cluster, current):
    opts = []
    for t, cap in enumerate(cluster.counts):
        for n in range(job.min_gpus, min(job.max_gpus, cap) + 1):
            if job.rates[t, n] > 0:
                a = Alloc(t, n)
                opts.append((a, job.est_time(a, current)))
    return opts


def solve_milp(jobs, cluster, allocation, order="arrival"):
    from scipy.optimize import Bounds, LinearConstraint, milp

    tent, _ = admit_at_minimum(jobs, cluster, allocation, order=order)
    if len(tent) > MAX_JOBS:
        raise UserError(f"policy optimal solves the integer program exactly and handles at most {MAX_JOBS} "
                        f"running jobs ({len(tent)} here); use doubling for large instances")
    admitted = [j for j in jobs if j.job_id in tent]
    if not admitted:
        return {}
    var_job, var_alloc, cost = [], [], []
    for k, job in enumerate(admitted):
        for a, c in _options(job, cluster, allocation.get(job.job_id)):
            var_job.append(k)
            var_alloc.append(a)
            cost.append(c)
    nv, nj, nt = len(cost), len(admitted), len(cluster.names)
    cost = np.array(cost)
    one = np.zeros((nj, nv))
    one[var_job, np.arange(nv)] = 1.0
    cap = np.zeros((nt, nv))
    for i, a in enumerate(var_alloc):
        cap[a.type, i] = a.n
    cons = [LinearConstraint(one, 1, 1), LinearConstraint(cap, -np.inf, cluster.capacity.astype(float))]
    scale = max(1.0, float(np.median(cost)))
    with quiet_stdout():
        res = milp(cost / scale, constraints=cons, integrality=np.ones(nv), bounds=Bounds(0, 1))
    if res.status != 0 or res.x is None:  # pragma: no cover - admission makes it feasible
        raise RuntimeError(f"MILP failed: {res.message}")
    out = {}
    for i in np.flatnonzero(res.x > 0.5):
        out[admitted[var_job[i]].job_id] = var_alloc[i]
    return out


def exhaustive(jobs, cluster, allocation):
    """Same problem by enumeration (tiny instances only)."""
    tent, _ = admit_at_minimum(jobs, cluster, allocation)
    admitted = [j for j in jobs if j.job_id in tent]
    choices = [_options(j, cluster, allocation.get(j.job_id)) for j in admitted]
    best, best_cost = {}, float("inf")
    for combo in itertools.product(*choices):
        used = np.zeros(len(cluster.names), dtype=np.int64)
        for a, _ in combo:
            used[a.type] += a.n
        if np.any(used > cluster.capacity):
            continue
        c = sum(x for _, x in combo)
        if c < best_cost:
            best_cost = c
            best = {j.job_id: a for j, (a, _) in zip(admitted, combo)}
    return best


def objective(jobs, allocation_now, plan):
    """Sum of estimated completion times of a plan (the IP's objective)."""
    by_id = {j.job_id: j for j in jobs}
    return float(sum(by_id[jid].est_time(a, allocation_now.get(jid)) for jid, a in plan.items()))


@register("optimal")
def optimal(jobs, cluster, allocation, now):
    return solve_milp(jobs, cluster, allocation)


@register("optimal-srpt")
def optimal_srpt(jobs, cluster, allocation, now):
    """The same integer program over the jobs `adaptive` admits (SRPT order): the
    per-decision optimum that hetrain's default policy approximates."""
    return solve_milp(jobs, cluster, allocation, order="srpt")


# yardsticks, told each job's true remaining work even when lengths are unknown to the rest
optimal.oracle = True  # type: ignore[attr-defined]
optimal_srpt.oracle = True  # type: ignore[attr-defined]
