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

est_jc = seconds to finish on c (remaining work / goodput, plus the restart penalty when
c differs from the job's current configuration), T_j = the same on the job's slowest
configuration (Sia normalises each job's goodputs by its slowest one
so that jobs of very different speeds compare). With p = 1 the objective is the sum
of the jobs' completion *rates* 1/est: short jobs and large speed-ups win, as in SRPT;
p < 1 flattens the speed-up (a job values its second GPU less than its first: Sia's
fairness knob, p -> 0 admits the most, shortest jobs), p > 1 sharpens it. Solved with
SciPy's HiGHS through `mckp.choose` (certified within 0.5%); `exhaustive` enumerates every choice for the tests.

Without told lengths (production), the remaining work is the mean residual length under
the distribution learned from the jobs that finished (`hetrain.sched.lengths`). The
restart penalty of a move is the restart cost, scaled up so that the move pays it back
within the time the new allocation is expected to hold (`HOLD_DECISIONS` of the mean
interval between decisions: the policy re-plans at every arrival and completion, so a
job grown into GPUs a newcomer will take back soon is not worth a restart), and a
running job's other configurations are discounted by Pollux's re-allocation factor
(`job.restart_factor`: a job that restarted often for its age is kept put), which
Sia adopts too.
"""
from __future__ import annotations

import itertools
import sys
from typing import Literal

import numpy as np

from ...errors import UserError
from ..job import Alloc, restart_factor
from ..lengths import MIN_FINISHED, LengthModel
from .base import register
from .mckp import MIP_GAP, Configs, Prices, _milp, choose  # noqa: F401  (MIP_GAP: tests)

DEFAULT_P = 0.5  # with lengths unknown the best of 1, 0.5, 0.25 on 2 of 3 three-type patterns (docs/scheduling.md)
NODE_GPUS = 8
HOLD_DECISIONS = 4  # a new allocation is expected to hold about this many decisions (docs/scheduling.md)
FINE_POOL = 128


def _allowed_counts(cluster, width: int) -> np.ndarray:
    """allowed[t, n]: n GPUs is a configuration size on type t: the powers of two (as Sia),
    and in a pool of at most FINE_POOL GPUs every count up to a machine's worth too (there
    a few GPUs left over matter); never more than the pool."""
    n = np.arange(width)
    out = np.zeros((len(cluster.counts), width), dtype=bool)
    for t, cap in enumerate(cluster.counts):
        fine = NODE_GPUS if cap <= FINE_POOL else 1
        ratio = n // fine
        power = (n % fine == 0) & (ratio > 0) & ((ratio & (ratio - 1)) == 0)
        out[t] = (((n >= 1) & (n <= fine)) | power) & (n <= cap)
    return out


def candidates(jobs, cluster, allocation) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(job index, type, count, rate) of every configuration the jobs may run on: an
    allowed count (`_allowed_counts`) within the job's bounds where it has a measured rate,
    and its current allocation; built for all jobs at once over a dense rates[job, type,
    count] table (one numpy pass instead of a loop per job and type: on 2,000 jobs the
    loops were a fifth of a cold decision)."""
    nj, nt = len(jobs), len(cluster.names)
    width = max(j.rates.shape[1] for j in jobs)
    rates = np.zeros((nj, nt, width))
    for i, j in enumerate(jobs):
        rates[i, :, :j.rates.shape[1]] = j.rates
    n = np.arange(width)
    lo = np.array([j.min_gpus for j in jobs])[:, None, None]
    hi = np.array([j.max_gpus for j in jobs])[:, None, None]
    ok = _allowed_counts(cluster, width)[None] & (n >= lo) & (n <= hi)
    cur = [(i, a.type, a.n) for i, j in enumerate(jobs) if (a := allocation.get(j.job_id)) is not None]
    if cur:  # staying put is always an option
        ci, ct, cn = (np.array(x, dtype=np.int64) for x in zip(*cur))
        ok[ci, ct, cn] |= cn <= np.minimum(hi[ci, 0, 0], np.asarray(cluster.counts)[ct])
    ok &= rates > 0
    jidx, ts, ns = np.nonzero(ok)
    return jidx, ts, ns, rates[jidx, ts, ns]


def configurations(jobs, cluster, allocation, p: float = DEFAULT_P, remaining: np.ndarray | None = None,
                   now: float | None = None, hold_s: float | None = None) -> Configs:
    """Every (job, type, count) a job can run on, with its value in the objective,
    priced for all jobs at once (numpy over the concatenated candidates). `remaining`
    (per job, its work units) replaces the jobs' own `remaining` when given; with `hold_s`
    (seconds a new allocation is expected to hold) a move's restart cost is scaled by
    max(1, seconds to finish there / hold_s); with `now`, a running job's other
    configurations are discounted by its re-allocation factor (module docstring)."""
    if not jobs:
        return Configs.empty()
    jidx, ts, ns, rate = candidates(jobs, cluster, allocation)
    if not len(jidx):
        return Configs.empty()
    sizes = np.bincount(jidx, minlength=len(jobs))
    cur_t = np.array([a.type if (a := allocation.get(j.job_id)) is not None else -1 for j in jobs])
    cur_n = np.array([a.n if (a := allocation.get(j.job_id)) is not None else -1 for j in jobs])
    penalty = np.array([j.restart_cost if j.started else 0.0 for j in jobs])
    rem = np.array([j.remaining for j in jobs], dtype=float) if remaining is None else np.asarray(remaining, float)
    same = (ts == cur_t[jidx]) & (ns == cur_n[jidx])
    run = rem[jidx] / rate
    est = np.where(same, 0.0, penalty[jidx]) + run
    # T_j, the reference, on the plain estimates: what follows only makes moves dearer and
    # must not also lower the value of staying put (a larger T_j would)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])[sizes > 0]
    ref = np.zeros(len(jobs))
    ref[sizes > 0] = np.maximum(np.maximum.reduceat(est, starts), 1e-9)
    if hold_s is not None:
        # a move pays its restart back only while the new allocation holds: charged as the
        # restart cost times the number of hold periods the job would need there
        est = np.where(same, est, run + penalty[jidx] * np.maximum(1.0, run / hold_s))
    if now is not None:
        factor = np.maximum(np.array([restart_factor(j, now) for j in jobs]), 1e-3)
        est = np.where(same, est, est / factor[jidx])
    val = (ref[jidx] / np.maximum(est, 1e-9)) ** p / ref[jidx]
    # a count worth no more than a smaller one on the same type only takes GPUs: drop it.
    # Within each (job, type) group in count order keep a column only if it beats every
    # smaller count: a running maximum that restarts per group (values scaled to (0, 1]
    # per job and offset by 2 per group so one accumulate serves every group).
    order = np.lexsort((ns, ts, jidx))
    vs, js, tss = val[order], jidx[order], ts[order]
    top = np.zeros(len(jobs))
    np.maximum.at(top, jidx, val)
    group = np.concatenate([[0], np.cumsum((js[1:] != js[:-1]) | (tss[1:] != tss[:-1]))])
    key = vs / top[js] + 2.0 * group
    prev = np.concatenate([[-1.0], np.maximum.accumulate(key)[:-1]])
    keep = np.zeros(len(val), dtype=bool)
    keep[order] = key > prev
    return Configs(jidx[keep], ts[keep], ns[keep], val[keep])


def solve(jobs, cluster, allocation, p: float = DEFAULT_P, time_limit: float | None = None,
          warm: Prices | None = None, remaining: np.ndarray | None = None, now: float | None = None,
          hold_s: float | None = None) -> dict[int, Alloc]:
    """The integer program above (`choose`); returns job_id -> Alloc for the jobs that run."""
    jobs = list(jobs)
    cfg = configurations(jobs, cluster, allocation, p, remaining, now, hold_s)
    if not len(cfg.value):
        return {}
    x = choose(cfg, len(jobs), cluster.capacity, warm) if time_limit is None else \
        _milp(cfg, len(jobs), cluster.capacity, time_limit)
    return {jobs[cfg.job[k]].job_id: Alloc(int(cfg.type[k]), int(cfg.n[k])) for k in np.flatnonzero(x)}


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


Lengths = Literal["learned", "prior"]


def goodput_policy(p: float = DEFAULT_P, name: str = "goodput", lengths: Lengths = "learned",
                   hold_decisions: float | None = HOLD_DECISIONS, realloc: bool = True):
    """A goodput policy with fairness knob p (> 0), flagged to run jobs at their best batch.
    The other arguments exist for the ablations (bench/sched_ablation.py): `lengths`
    "prior" keeps the simulator's prior rule instead of the learned mean residual,
    `hold_decisions` None charges a move its restart cost once, `realloc` False drops
    Pollux's re-allocation factor."""
    if not p > 0:
        raise UserError(f"the fairness knob p must be > 0, got {p}")
    if hold_decisions is not None and not hold_decisions > 0:
        raise UserError(f"hold_decisions must be > 0 (or None), got {hold_decisions}")

    warm = Prices()  # the last decision's GPU prices: a hint, every plan is certified anew
    model = LengthModel(min_finished=MIN_FINISHED if lengths == "learned" else sys.maxsize)
    times: list[float] = []  # the first and the latest decision's time, and how many decisions

    def policy(jobs, cluster, allocation, now):
        jobs = list(jobs)
        model.observe(jobs)
        times[:] = [times[0] if times else now, now, (times[2] if times else 0) + 1]
        hold = None
        if hold_decisions is not None and times[1] > times[0]:  # the mean interval between decisions
            hold = hold_decisions * (times[1] - times[0]) / (times[2] - 1)
        return solve(jobs, cluster, allocation, p, warm=warm, remaining=model.remaining(jobs),
                     now=now if realloc else None, hold_s=hold)

    policy.policy_name = name
    policy.adapts_batch = True
    # the same policy without carried prices or lengths
    policy.fresh = lambda: goodput_policy(p, name, lengths, hold_decisions, realloc)
    return policy


register("goodput")(goodput_policy(DEFAULT_P))
