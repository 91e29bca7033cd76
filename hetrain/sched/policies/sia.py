"""Sia (Jayaram Subramanya et al., SOSP '23) as a peer, written from the paper's published
formulation (not from its code): one integer program per decision over every (job, GPU
type, count) configuration, valued by goodput alone (Sia is not told job lengths).

- **Goodput** G_jc of job j on configuration c: the Pollux goodput at the best batch
  (`hetrain.perf.goodput`, bootstrapped from one-GPU profiles per type; the same table
  the default policy reads), counts as the default's (`goodput.candidates`).
- **Normalisation**: G'_jc = G_jc / min_c G_jc (each job's goodputs relative to its
  slowest configuration, so jobs of different speeds compare).
- **Restart penalty**: a configuration other than a running job's current one is worth
  r_j G'_jc, r_j = max(0, (age_j - restarts_j x delta_j) / (age_j + delta_j)) (Pollux's
  re-allocation factor, which Sia adopts: a young or often-restarted job is kept put),
  age = time since arrival, delta = the job's restart cost.
- **Objective with fairness exponent p** (Sia's default p = -0.5): for p < 0 minimise
  sum_j [sum_c A_jc (r G')_jc^p + lambda (1 - sum_c A_jc)], i.e. maximise
  sum_jc A_jc (lambda - (r G')_jc^p): a held job is worth lambda - 1 at its slowest
  configuration and a speed-up adds less than 1 (less and less as p falls), so with
  lambda = 2 (the default here; the paper leaves it a knob) k jobs on one GPU each are
  always worth more than one job on k GPUs: as many jobs as fit run (Sia's fairness);
  for p > 0 maximise sum_jc A_jc ((r G')_jc^p + lambda).
  Constraints: at most one configuration per job, each type's GPU count.
- Solved with the same certified multiple-choice-knapsack solver as the default
  (`mckp.choose`, HiGHS). Sia re-plans every 60 s round; here it re-plans at every
  arrival and completion (as every policy of the simulator), which is no less
  responsive.
"""
from __future__ import annotations

import numpy as np

from ...errors import UserError
from ..job import Alloc, restart_factor  # noqa: F401  (restart_factor: Sia's restart penalty, tests)
from .base import register
from .goodput import candidates
from .mckp import DECOMPOSE_GAP, Configs, Prices, choose

SIA_P = -0.5
SIA_LAMBDA = 2.0


def sia_configurations(jobs, cluster, allocation, now: float, p: float = SIA_P, lam: float = SIA_LAMBDA) -> Configs:
    """Every configuration with its value in Sia's objective (see the module docstring),
    for all jobs at once."""
    if not jobs:
        return Configs.empty()
    jidx, ts, ns, good = candidates(jobs, cluster, allocation)
    if not len(jidx):
        return Configs.empty()
    low = np.full(len(jobs), np.inf)
    np.minimum.at(low, jidx, good)
    norm = good / low[jidx]
    cur_t = np.array([a.type if (a := allocation.get(j.job_id)) is not None else -1 for j in jobs])
    cur_n = np.array([a.n if (a := allocation.get(j.job_id)) is not None else -1 for j in jobs])
    same = (ts == cur_t[jidx]) & (ns == cur_n[jidx])
    factor = np.array([restart_factor(j, now) for j in jobs])
    norm = np.where(same, norm, norm * factor[jidx])
    if p < 0:
        with np.errstate(divide="ignore"):
            val = lam - np.where(norm > 0, norm, 1e-12) ** p
    else:
        val = norm ** p + lam
    ok = val > 0
    return Configs(jidx[ok], ts[ok], ns[ok], val[ok])


def sia_policy(p: float = SIA_P, lam: float = SIA_LAMBDA, name: str = "sia", gap: float = DECOMPOSE_GAP):
    """Sia's policy with fairness exponent p (!= 0) and unallocated-job penalty lambda;
    plans certified within `gap` of the optimum (0: exact)."""
    if p == 0 or not np.isfinite(p):
        raise UserError(f"Sia's fairness exponent p must be a non-zero number, got {p}")
    if not lam > 1:
        raise UserError(f"Sia's lambda must be > 1 (a held job is worth more than none), got {lam}")
    warm = Prices()

    def policy(jobs, cluster, allocation, now):
        jobs = list(jobs)
        cfg = sia_configurations(jobs, cluster, allocation, now, p, lam)
        if not len(cfg.value):
            return {}
        x = choose(cfg, len(jobs), cluster.capacity, warm, gap)
        return {jobs[cfg.job[k]].job_id: Alloc(int(cfg.type[k]), int(cfg.n[k])) for k in np.flatnonzero(x)}

    policy.policy_name = name
    policy.adapts_batch = True  # Sia runs each job at its goodput-optimal batch, as Pollux
    policy.fresh = lambda: sia_policy(p, lam, name, gap)
    return policy


register("sia")(sia_policy())
