"""Goodput-aware allocation across GPU types: one integer program per decision (Sia).

Every active job j has configurations c = (GPU type, count), counts being the powers
of two in [min_gpus, max_gpus] (and, in pools of at most 128 GPUs, every count up to
one machine, 8 GPUs) that fit the type's pool (and the job's current count, so staying put is always an option). A configuration's speed is the job's goodput
there at its best batch (`hetrain.perf.goodput`: the simulator and the executor run
jobs with this policy at that batch; a restart hands the job its new batch). The
integer program picks at most one configuration per job within each pool's capacity:

    maximise   sum_jc x_jc v_jc     v_jc = (T_j / est_jc)^p / T_j
    subject to sum_c x_jc <= 1 (every job),  sum_jc n_c x_jc [type_c = t] <= cap_t
               x binary

est_jc = seconds to finish on c (remaining work / goodput, plus the restart cost when c
differs from the job's current configuration: the restart penalty), T_j = the same on
the job's slowest configuration (Sia normalises each job's goodputs by its slowest one
so that jobs of very different speeds compare). With p = 1 the objective is the sum
of the jobs' completion *rates* 1/est: short jobs and large speed-ups win, as in SRPT;
p < 1 flattens the speed-up (a job values its second GPU less than its first: Sia's
fairness knob, p -> 0 admits the most, shortest jobs), p > 1 sharpens it. Solved with
SciPy's HiGHS (`milp`); `exhaustive` enumerates every choice for the tests.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ...errors import UserError
from ..job import Alloc
from . import register

DEFAULT_P = 1.0
MIP_GAP = 1e-4  # relative optimality gap HiGHS stops at
NODE_GPUS = 8
FINE_POOL = 128


@dataclass(frozen=True)
class Configs:
    """The integer program's columns: job index, type, count and value of each."""

    job: np.ndarray
    type: np.ndarray
    n: np.ndarray
    value: np.ndarray


def _counts(job, cap: int, current: int | None) -> list[int]:
    """Powers of two (as Sia), and in a pool of at most FINE_POOL GPUs every count up to
    a machine's worth too (there a few GPUs left over matter)."""
    top = min(job.max_gpus, cap)
    fine = NODE_GPUS if cap <= FINE_POOL else 1
    out = list(range(job.min_gpus, min(top, fine) + 1))
    k = 2 * fine
    while k <= top:
        if k >= job.min_gpus:
            out.append(k)
        k *= 2
    if current is not None and current <= top and current not in out:
        out.append(current)
    return out


def configurations(jobs, cluster, allocation, p: float = DEFAULT_P) -> Configs:
    """Every (job, type, count) a job can run on, with its value in the objective."""
    cols_j, cols_t, cols_n, cols_v = [], [], [], []
    for i, job in enumerate(jobs):
        cur = allocation.get(job.job_id)
        ts, ns = [], []
        for t, cap in enumerate(cluster.counts):
            for n in _counts(job, int(cap), cur.n if cur is not None and cur.type == t else None):
                if job.rates[t, n] > 0:
                    ts.append(t)
                    ns.append(n)
        if not ts:
            continue
        ts_a, ns_a = np.array(ts), np.array(ns)
        rate = job.rates[ts_a, ns_a]
        same = np.array([cur is not None and cur == Alloc(t, n) for t, n in zip(ts, ns)])
        restart = np.where(same, 0.0, job.restart_cost if job.started else 0.0)
        est = restart + job.remaining / rate
        ref = max(float(est.max()), 1e-9)
        val = (ref / np.maximum(est, 1e-9)) ** p / ref
        # a count worth no more than a smaller one on the same type only takes GPUs: drop it
        order = np.lexsort((ns_a, ts_a))
        keep = np.zeros(len(ts), dtype=bool)
        best_on = {}
        for k in order.tolist():
            if val[k] > best_on.get(ts[k], 0.0):
                keep[k] = True
                best_on[ts[k]] = val[k]
        cols_j.append(np.full(int(keep.sum()), i))
        cols_t.append(ts_a[keep])
        cols_n.append(ns_a[keep])
        cols_v.append(val[keep])
    if not cols_j:
        e = np.zeros(0, dtype=np.int64)
        return Configs(e, e, e, np.zeros(0))
    return Configs(np.concatenate(cols_j), np.concatenate(cols_t), np.concatenate(cols_n), np.concatenate(cols_v))


def solve(jobs, cluster, allocation, p: float = DEFAULT_P, time_limit: float | None = None) -> dict[int, Alloc]:
    """The integer program above, by HiGHS; returns job_id -> Alloc for the jobs that run."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    jobs = list(jobs)
    cfg = configurations(jobs, cluster, allocation, p)
    nv = len(cfg.value)
    if nv == 0:
        return {}
    cols = np.arange(nv)
    one = csr_array((np.ones(nv), (cfg.job, cols)), shape=(len(jobs), nv))
    cap = csr_array((cfg.n.astype(float), (cfg.type, cols)), shape=(len(cluster.names), nv))
    cons = [LinearConstraint(one, -np.inf, 1.0),
            LinearConstraint(cap, -np.inf, np.asarray(cluster.capacity, dtype=float))]
    scale = float(cfg.value.max())
    # the relaxation is nearly integral (a multiple-choice knapsack with one row per GPU
    # type): presolve costs more than it saves, and a 1e-4 relative gap ends the search
    options = {"mip_rel_gap": MIP_GAP, "presolve": False}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    res = milp(-cfg.value / scale, constraints=cons, integrality=np.ones(nv), bounds=Bounds(0, 1), options=options)
    if res.x is None:  # pragma: no cover - x = 0 is always feasible
        raise RuntimeError(f"the goodput integer program failed: {res.message}")
    out = {}
    for k in np.flatnonzero(res.x > 0.5):
        out[jobs[cfg.job[k]].job_id] = Alloc(int(cfg.type[k]), int(cfg.n[k]))
    return out


def objective(jobs, cluster, allocation, plan, p: float = DEFAULT_P) -> float:
    """The integer program's objective for a plan (job_id -> Alloc)."""
    cfg = configurations(jobs, cluster, allocation, p)
    ids = [j.job_id for j in jobs]
    total = 0.0
    for jid, a in plan.items():
        k = np.flatnonzero((cfg.job == ids.index(jid)) & (cfg.type == a.type) & (cfg.n == a.n))
        total += float(cfg.value[k[0]])
    return total


def exhaustive(jobs, cluster, allocation, p: float = DEFAULT_P) -> tuple[float, dict[int, Alloc]]:
    """The same problem by enumeration (tiny instances only): (best objective, plan)."""
    jobs = list(jobs)
    if len(jobs) > 6:
        raise UserError("exhaustive enumeration is for at most 6 jobs")
    cfg = configurations(jobs, cluster, allocation, p)
    choices = [[None] + [k for k in range(len(cfg.value)) if cfg.job[k] == i] for i in range(len(jobs))]
    best, best_plan = 0.0, {}
    for combo in itertools.product(*choices):
        used = np.zeros(len(cluster.names))
        val = 0.0
        for k in combo:
            if k is not None:
                used[cfg.type[k]] += cfg.n[k]
                val += cfg.value[k]
        if np.all(used <= cluster.capacity) and val > best + 1e-12:
            best = val
            best_plan = {jobs[cfg.job[k]].job_id: Alloc(int(cfg.type[k]), int(cfg.n[k])) for k in combo if k is not None}
    return best, best_plan


def goodput_policy(p: float = DEFAULT_P, name: str = "goodput"):
    """A goodput policy with fairness knob p (> 0), flagged to run jobs at their best batch."""
    if not p > 0:
        raise UserError(f"the fairness knob p must be > 0, got {p}")

    def policy(jobs, cluster, allocation, now):
        return solve(jobs, cluster, allocation, p)

    policy.policy_name = name
    policy.adapts_batch = True
    return policy


register("goodput")(goodput_policy(DEFAULT_P))
