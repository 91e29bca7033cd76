"""Scheduling policies. Every policy has the same signature, used by the simulator
and the live executor alike:

    policy(jobs, cluster, allocation, now) -> allocation

`jobs` are the active jobs (arrived, unfinished; `remaining` is current), `allocation`
maps job_id -> Alloc(type, n) for the jobs that hold GPUs now, and the result is the
new allocation (absent = no GPUs). Policies are pure functions of their arguments.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ...errors import UserError
from ..cluster import GpuCluster
from ..job import Alloc, Allocation, Job

Policy = Callable[[Sequence[Job], GpuCluster, Allocation, float], Allocation]
_REGISTRY: dict[str, Policy] = {}


def register(name: str):
    def deco(fn: Policy) -> Policy:
        _REGISTRY[name] = fn
        fn.policy_name = name  # type: ignore[attr-defined]
        return fn
    return deco


def get_policy(name: str) -> Policy:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown policy {name!r}; choose one of {', '.join(policy_names())}") from None


def policy_names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def _load_all() -> None:
    from . import doubling, fifo, optimal, srtf  # noqa: F401  (modules register themselves)


def check_allocation(jobs: Sequence[Job], cluster: GpuCluster, alloc: Allocation) -> None:
    """Raise if an allocation exceeds a pool, breaks a job's bounds or names an unknown job."""
    used = np.zeros(len(cluster.types), dtype=np.int64)
    by_id = {j.job_id: j for j in jobs}
    for jid, a in alloc.items():
        job = by_id.get(jid)
        if job is None:
            raise RuntimeError(f"allocation names job {jid}, which is not active")
        if not (job.min_gpus <= a.n <= job.max_gpus) or job.rate(a) <= 0:
            raise RuntimeError(f"job {jid} got {a.n} GPUs of type {a.type}: outside its bounds or unmeasured")
        used[a.type] += a.n
    if np.any(used > cluster.capacity):
        raise RuntimeError(f"allocation uses {used.tolist()} GPUs, more than the cluster's {list(cluster.counts)}")


def type_weights(jobs: Sequence[Job], ntypes: int) -> np.ndarray:
    """Average relative speed of each GPU type over the jobs (1 = every job's fastest)."""
    if not jobs:
        return np.ones(ntypes)
    r1 = np.stack([j.rates[:, 1] for j in jobs])
    best = r1.max(axis=1, keepdims=True)
    best[best <= 0] = 1.0
    w = (r1 / best).mean(axis=0)
    w[w <= 0] = 1e-9
    return w


def admit_at_minimum(jobs: Sequence[Job], cluster: GpuCluster, allocation: Allocation
                     ) -> tuple[dict[int, Alloc], np.ndarray]:
    """Give jobs their minimum size on one GPU type each; returns the tentative
    allocation and the free GPUs per type.

    Who is admitted: running jobs first, then waiting jobs in arrival order, until no
    pool has room for the next one's minimum. Which type (the heterogeneous extension
    of the seed's heuristic): admitted jobs pick their type in order of *regret*, the
    seconds they would lose on their worst usable type versus their best, so jobs that
    gain most from fast GPUs (long jobs, jobs that run well on V100s) get them first.
    A type is judged at the size the job may grow to there (an equal share of the pool
    with the jobs already placed on it), not at its minimum: a job can be faster on a P100 than on a V100 alone
    yet much faster on eight V100s.
    Estimates charge the restart cost when the type or size differs from the current one.
    """
    free = cluster.capacity.copy()
    ntypes = len(cluster.types)
    running = sorted((j for j in jobs if j.job_id in allocation), key=lambda j: (j.arrival, j.job_id))
    waiting = sorted((j for j in jobs if j.job_id not in allocation), key=lambda j: (j.arrival, j.job_id))
    admitted: list[Job] = []
    count_free = free.copy()
    for job in running + waiting:
        m = job.min_gpus
        ok = np.flatnonzero((count_free >= m) & (job.rates[:, m] > 0))
        if len(ok):
            admitted.append(job)
            count_free[ok[np.argmax(count_free[ok])]] -= m
    if ntypes == 1:
        return {j.job_id: Alloc(0, j.min_gpus) for j in admitted}, count_free
    costs = []
    # judge each type at the size a job could expect there: its fair share of the cluster
    fair = max(1, cluster.total // max(1, len(admitted)))
    for job in admitted:
        cur = allocation.get(job.job_id)
        c = np.full(ntypes, np.inf)
        for t in range(ntypes):
            n = job.feasible_n(t, min(max(fair, job.min_gpus), cluster.counts[t]))
            if n:
                c[t] = job.est_time(Alloc(t, n), cur)
        fin = c[np.isfinite(c)]
        costs.append((-(fin.max() - fin.min()), job.arrival, job.job_id, c, job))
    costs.sort(key=lambda x: x[:3])
    out: dict[int, Alloc] = {}
    on_type = np.zeros(ntypes, dtype=np.int64)
    for _, _, jid, _, job in costs:
        m = job.min_gpus
        cur = allocation.get(jid)
        best_t, best_c = -1, np.inf
        for t in range(ntypes):
            if free[t] < m:
                continue
            # the size this job may expect on t: an equal share with the jobs already there
            n = job.feasible_n(t, max(m, cluster.counts[t] // (on_type[t] + 1)))
            c = job.est_time(Alloc(t, n), cur) if n else np.inf
            if c < best_c:
                best_t, best_c = t, c
        if best_t >= 0:
            out[jid] = Alloc(best_t, m)
            free[best_t] -= m
            on_type[best_t] += 1
    return out, free
