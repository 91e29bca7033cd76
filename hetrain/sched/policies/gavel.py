"""Gavel's heterogeneity-aware allocation (Narayanan et al., OSDI 2020), the peer a user
would compare a heterogeneous-cluster scheduler against.

Gavel does not resize jobs: each job runs at the GPU count it asked for (its *scale
factor* s_j), and the policy decides what fraction of time X[j, t] job j spends on GPU
type t. This is its max-min fairness (heterogeneity-aware LAS) policy, an LP over
*effective throughputs*: maximise min_j  sum_t tput[j, t] X[j, t] s_j / iso_j, subject
to sum_t X[j, t] <= 1 (a job runs on one type at a time) and sum_j s_j X[j, t] <= C_t
(pool capacities), where tput[j, t] is the job's measured rate on s_j GPUs of type t and
iso_j its rate under an equal share of the cluster (the same fraction of time for every
job, spread over the types in proportion to their sizes), so every job's progress is
judged relative to what it would get on its own slice.
Solved with SciPy's HiGHS (Gavel uses cvxpy).

Time sharing: the shares are realised by Gavel's round-based mechanism. Every round
(`ROUND_S`, 6 minutes as in the paper) the LP is solved again and each (job, type) pair
gets the priority X[j, t] / f[j, t], where f[j, t] is the fraction of its time in the
system that job j has held GPUs of type t (never-run pairs first); pairs are placed in
decreasing priority, a job at most once, each with its s_j GPUs if they fit. A job
whose allocation changes between rounds is preempted and resumed, which the simulator
(and the executor) charge as a restart, as for every other policy.
"""
from __future__ import annotations

import numpy as np

from ..job import Alloc
from ...quiet import quiet_stdout
from .base import register

ROUND_S = 360.0
_CACHE: dict = {}  # LP solutions by (throughputs, scale factors, capacities)


def _max_min(coef: np.ndarray, sf: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """max z s.t. z <= sum_t coef[j,t] x[j,t];  sum_t x[j,t] <= 1;  sum_j sf_j x[j,t] <= C_t; x >= 0."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix, vstack

    nj, nt = coef.shape
    nv = nj * nt + 1  # x (row-major) then z
    rows = np.repeat(np.arange(nj), nt)
    cols = np.arange(nj * nt)
    # z - sum_t coef x <= 0
    a1 = coo_matrix((np.concatenate([-coef.ravel(), np.ones(nj)]),
                     (np.concatenate([rows, np.arange(nj)]), np.concatenate([cols, np.full(nj, nj * nt)]))),
                    shape=(nj, nv))
    a2 = coo_matrix((np.ones(nj * nt), (rows, cols)), shape=(nj, nv))
    a3 = coo_matrix((np.repeat(sf, nt), (np.tile(np.arange(nt), nj), cols)), shape=(nt, nv))
    a_ub = vstack([a1, a2, a3]).tocsr()
    b_ub = np.concatenate([np.zeros(nj), np.ones(nj), caps.astype(float)])
    bounds = [(0.0, 1.0 if c > 0 else 0.0) for c in coef.ravel()] + [(0.0, None)]
    c = np.zeros(nv)
    c[-1] = -1.0
    with quiet_stdout():
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if res.status != 0:  # pragma: no cover - x = 0 is always feasible
        raise RuntimeError(f"Gavel's LP failed: {res.message}")
    return res.x[:-1].reshape(nj, nt).clip(0.0, 1.0)


def scale_factors(jobs) -> tuple[np.ndarray, np.ndarray]:
    """Each job's GPU count (what it asked for, or the largest measured count below it)
    and its rate there on every type."""
    sf = np.empty(len(jobs), dtype=np.int64)
    tput = np.empty((len(jobs), jobs[0].rates.shape[0]))
    for i, j in enumerate(jobs):
        n = min(j.requested, j.max_gpus)
        while n > j.min_gpus and not j.rates[:, n].any():
            n -= 1
        sf[i] = n
        tput[i] = j.rates[:, n]
    return sf, tput


def equal_shares(usable: np.ndarray, sf: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Gavel's reference allocation: every job the same fraction of time, spread over the
    types it can use in proportion to their pool sizes (its "1/n of the cluster")."""
    f = min(1.0, float(caps.sum()) / max(float(sf.sum()), 1e-9))
    w = usable * caps[None, :].astype(float)
    tot = w.sum(axis=1, keepdims=True)
    return np.where(tot > 0, f * w / np.where(tot > 0, tot, 1.0), 0.0)


def time_shares(jobs, cluster) -> tuple[np.ndarray, np.ndarray]:
    """Gavel's X[j, t] for the active jobs, and their scale factors."""
    sf, tput = scale_factors(jobs)
    tput[sf[:, None] > cluster.capacity[None, :]] = 0.0
    key = (tput.tobytes(), sf.tobytes(), cluster.capacity.tobytes())
    x = _CACHE.get(key)
    if x is None:  # the LP depends only on the active jobs' throughputs: re-solved when they change
        iso = (tput * equal_shares(tput > 0, sf, cluster.capacity)).sum(axis=1)
        iso[iso <= 0] = 1.0
        x = _max_min(tput * sf[:, None] / iso[:, None], sf, cluster.capacity)
        if len(_CACHE) >= 16:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = x
    return x, sf


@register("gavel")
def gavel(jobs, cluster, allocation, now):
    if not jobs:
        return {}
    x, sf = time_shares(jobs, cluster)
    held = np.array([j.service_s for j in jobs])  # seconds on each type so far
    in_system = np.maximum(now - np.array([j.arrival for j in jobs]), 1e-9)
    frac = held / in_system[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        prio = np.where(frac > 0, x / frac, np.where(x > 0, np.inf, 0.0))
    # by priority (never-run pairs first), then share, then earlier arrival
    arrival = np.repeat([j.arrival for j in jobs], x.shape[1])
    flat = np.lexsort((arrival, -x.ravel(), -prio.ravel()))
    flat = flat[x.ravel()[flat] > 1e-9]
    free = cluster.capacity.copy()
    out: dict[int, Alloc] = {}
    for k in flat.tolist():
        j, t = divmod(k, x.shape[1])
        job, n = jobs[j], int(sf[j])
        if job.job_id in out or free[t] < n:
            continue
        out[job.job_id] = Alloc(t, n)
        free[t] -= n
    return out


gavel.round_s = ROUND_S  # type: ignore[attr-defined]
