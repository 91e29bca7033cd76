"""What every scheduling policy shares: the signature (`Policy`), the name each goes by
(`register`, filling the registry that `hetrain.sched.policies` serves), the check of an
allocation, and admission at each job's minimum size (used by the doubling, adaptive and
optimal policies). The policies' modules import this one, never the package, so the
package can load them without importing itself back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ...cluster.hardware import Inventory
from ...perf.jobs import completion_time
from ..job import Alloc, Allocation, Job

Policy = Callable[[Sequence[Job], Inventory, Allocation, float], Allocation]
DEFAULT_POLICY = "goodput"  # what `hetrain schedule` uses unless told otherwise (bench/sched.py: no worse than any peer)
_REGISTRY: dict[str, Policy] = {}


def register(name: str):
    def deco(fn: Policy) -> Policy:
        _REGISTRY[name] = fn
        fn.policy_name = name  # type: ignore[attr-defined]
        return fn
    return deco


def check_allocation(jobs: Sequence[Job], cluster: Inventory, alloc: Allocation) -> None:
    """Raise if an allocation exceeds a pool, breaks a job's bounds or names an unknown job."""
    used = np.zeros(len(cluster.names), dtype=np.int64)
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


@dataclass
class _JobTables:
    """Dense per-job tables for admission, one row per job in `order`: rates R[j, t, n],
    minimum size, remaining work, restart penalty (0 until started) and the current
    allocation's type and size (-1 when the job holds no GPUs)."""

    order: list[Job]
    rates: np.ndarray
    mins: np.ndarray
    rem: np.ndarray
    penalty: np.ndarray
    cur_t: np.ndarray
    cur_n: np.ndarray

    @classmethod
    def build(cls, order: list[Job], allocation: Allocation, ntypes: int) -> "_JobTables":
        width = max(j.rates.shape[1] for j in order)
        nj = len(order)
        t = cls(order, np.zeros((nj, ntypes, width)), np.empty(nj, dtype=np.int64), np.empty(nj), np.zeros(nj),
                np.full(nj, -1), np.full(nj, -1))
        for i, j in enumerate(order):
            t.rates[i, :, :j.rates.shape[1]] = j.rates
            t.mins[i] = j.min_gpus
            t.rem[i] = j.remaining
            if j.started:
                t.penalty[i] = j.restart_cost
            a = allocation.get(j.job_id)
            if a is not None:
                t.cur_t[i], t.cur_n[i] = a.type, a.n
        return t

    @property
    def width(self) -> int:
        return self.rates.shape[2]

    def sorted_by_srpt(self) -> "_JobTables":
        """Shortest estimated remaining time at the minimum size first (restart charged; a
        running job may keep its current allocation instead); ties by arrival, then id."""
        nj, width = len(self.order), self.width
        at_min = self.rates[np.arange(nj), :, np.minimum(self.mins, width - 1)]
        key = completion_time(self.rem[:, None], at_min, self.penalty[:, None]).min(axis=1)
        running_now = self.cur_t >= 0
        key[running_now] = np.minimum(key[running_now], completion_time(
            self.rem[running_now], self.rates[np.flatnonzero(running_now), self.cur_t[running_now],
                                              self.cur_n[running_now]]))
        perm = np.lexsort((np.array([j.job_id for j in self.order]), np.array([j.arrival for j in self.order]), key))
        return _JobTables([self.order[i] for i in perm], *(x[perm] for x in (
            self.rates, self.mins, self.rem, self.penalty, self.cur_t, self.cur_n)))


def _admit_by_count(feas: np.ndarray, mins: np.ndarray, caps: list[int]) -> tuple[list[int], list[int]]:
    """Who is admitted: in table order, each job whose minimum fits in some pool, taking it
    from the pool with the most free GPUs; returns the admitted rows and the GPUs left."""
    nj, ntypes, width = feas.shape
    count_free = list(caps)
    admitted: list[int] = []
    feas_min = feas[np.arange(nj), :, np.minimum(mins, width - 1)]  # (nj, ntypes)
    ok_min = (feas_min == mins[:, None]).tolist()
    for i in range(nj):
        m = int(mins[i])
        best_t, best_free = -1, -1
        for t in range(ntypes):
            if ok_min[i][t] and count_free[t] >= m and count_free[t] > best_free:
                best_t, best_free = t, count_free[t]
        if best_t >= 0:
            admitted.append(i)
            count_free[best_t] -= m
    return admitted, count_free


def _place_by_regret(tab: _JobTables, feas: np.ndarray, admitted: list[int], cluster: Inventory,
                     free: np.ndarray) -> dict[int, Alloc]:
    """Which type each admitted job gets: in order of regret (seconds lost on the worst usable
    type versus the best, judged at a fair share of the cluster), each takes the type where
    it would finish soonest at an equal share with the jobs already placed there. `free` is
    updated in place."""
    ntypes, width, caps = len(cluster.names), tab.width, list(cluster.counts)
    ks = np.arange(width)
    adm = np.array(admitted, dtype=np.int64)
    same = (ks[None, None, :] == tab.cur_n[adm, None, None]) & \
        (np.arange(ntypes)[None, :, None] == tab.cur_t[adm, None, None])
    cost = completion_time(tab.rem[adm, None, None], tab.rates[adm], np.where(same, 0.0, tab.penalty[adm, None, None]))
    f = feas[adm]
    # judge each type at the size a job could expect there: its fair share of the cluster
    fair = max(1, cluster.total // max(1, len(adm)))
    want = np.minimum(np.maximum(fair, tab.mins[adm])[:, None], np.array(caps)[None, :])
    want = np.minimum(want, width - 1)
    n_fair = np.take_along_axis(f, want[:, :, None], axis=2)[:, :, 0]
    c_fair = np.take_along_axis(cost, n_fair[:, :, None], axis=2)[:, :, 0]
    c_fair = np.where(n_fair > 0, c_fair, np.inf)
    fin = np.isfinite(c_fair)
    regret = np.where(fin.any(axis=1), np.where(fin, c_fair, -np.inf).max(axis=1) - np.where(fin, c_fair, np.inf).min(axis=1), 0.0)
    arr = np.array([tab.order[i].arrival for i in adm])
    ids = np.array([tab.order[i].job_id for i in adm])
    rank = np.lexsort((ids, arr, -regret))
    f_l, c_l = f.tolist(), cost.tolist()
    out: dict[int, Alloc] = {}
    on_type = [0] * ntypes
    for k in rank.tolist():
        i = int(adm[k])
        m = int(tab.mins[i])
        best_t, best_c = -1, np.inf
        for t in range(ntypes):
            if free[t] < m:
                continue
            # the size this job may expect on t: an equal share with the jobs already there
            n = f_l[k][t][min(max(m, caps[t] // (on_type[t] + 1)), width - 1)]
            c = c_l[k][t][n] if n else np.inf
            if c < best_c:
                best_t, best_c = t, c
        if best_t >= 0:
            out[tab.order[i].job_id] = Alloc(best_t, m)
            free[best_t] -= m
            on_type[best_t] += 1
    return out


def admit_at_minimum(jobs: Sequence[Job], cluster: Inventory, allocation: Allocation, order: str = "arrival"
                     ) -> tuple[dict[int, Alloc], np.ndarray]:
    """Give jobs their minimum size on one GPU type each; returns the tentative
    allocation and the free GPUs per type.

    Who is admitted: with order="arrival" (the paper's), running jobs first, then
    waiting jobs in arrival order; with order="srpt", every job by its estimated
    remaining time at its minimum size on its best type (restart charged; a running job
    may keep its current allocation instead), shortest first; in both, until no pool has
    room for the next one's minimum. Which type (the heterogeneous extension
    of the seed's heuristic): admitted jobs pick their type in order of *regret*, the
    seconds they would lose on their worst usable type versus their best, so jobs that
    gain most from fast GPUs (long jobs, jobs that run well on V100s) get them first.
    A type is judged at the size the job may grow to there (an equal share of the pool
    with the jobs already placed on it), not at its minimum: a job can be faster on a P100 than on a V100 alone
    yet much faster on eight V100s.
    Estimates charge the restart cost when the type or size differs from the current one.
    """
    free = cluster.capacity.copy()
    running = sorted((j for j in jobs if j.job_id in allocation), key=lambda j: (j.arrival, j.job_id))
    waiting = sorted((j for j in jobs if j.job_id not in allocation), key=lambda j: (j.arrival, j.job_id))
    if not running + waiting:
        return {}, free
    # dense tables over the jobs (rates R[j, t, n], ...) and the largest usable count <= n F[j, t, n]
    tab = _JobTables.build(running + waiting, allocation, len(cluster.names))
    if order == "srpt":
        tab = tab.sorted_by_srpt()
    ks = np.arange(tab.width)
    usable = (tab.rates > 0) & (ks[None, None, :] >= tab.mins[:, None, None])
    feas = np.maximum.accumulate(np.where(usable, ks[None, None, :], 0), axis=2)
    admitted, count_free = _admit_by_count(feas, tab.mins, list(cluster.counts))
    if len(cluster.names) == 1:
        return {tab.order[i].job_id: Alloc(0, int(tab.mins[i])) for i in admitted}, np.array(count_free, dtype=np.int64)
    return _place_by_regret(tab, feas, admitted, cluster, free), free
