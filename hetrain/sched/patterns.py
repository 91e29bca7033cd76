"""Synthetic workloads: arrival patterns x job-length mixes, over Gavel's measured job types.

Arrivals: ``all-at-once`` (every job at t=0), ``poisson`` (exponential gaps sized so
the offered load is `load` x the cluster), ``bursts`` (groups of jobs arriving
together, groups Poisson-spaced). Lengths: ``short`` (15 min to 1 h alone on one
GPU of the job's best type), ``long`` (2 to 8 h), ``mixed`` (80% short, 20% long).
A pattern name may carry the mix: ``poisson-long``, ``bursts-mixed``.
"""
from __future__ import annotations

import numpy as np

from ..cluster.hardware import Inventory
from ..errors import UserError
from .gavel import load_batch_models, load_throughputs
from .job import Job, make_job

ARRIVALS = ("all-at-once", "poisson", "bursts")
MIXES = ("short", "long", "mixed")
# Philly-like request sizes: mostly single-GPU jobs
_REQ_SIZES = np.array([1, 2, 4, 8])
_REQ_PROBS = np.array([0.6, 0.2, 0.15, 0.05])


def pattern_names() -> list[str]:
    return [a for a in ARRIVALS] + [f"{a}-{m}" for a in ARRIVALS for m in MIXES]


def split_name(name: str) -> tuple[str, str]:
    for a in ARRIVALS:
        if name == a:
            return a, "mixed"
        for m in MIXES:
            if name == f"{a}-{m}":
                return a, m
    raise UserError(f"unknown pattern {name!r}; choose one of {', '.join(pattern_names())}")


def _durations(rng: np.random.Generator, mix: str, n: int) -> np.ndarray:
    short = rng.uniform(np.log(900), np.log(3600), n)
    long = rng.uniform(np.log(7200), np.log(28800), n)
    if mix == "short":
        return np.exp(short)
    if mix == "long":
        return np.exp(long)
    return np.exp(np.where(rng.random(n) < 0.8, short, long))


def make_pattern(name: str, n_jobs: int, cluster: Inventory, seed: int = 0, load: float = 1.0,
                 restart_cost: float = 10.0, throughputs: str | None = None, max_request: int | None = None,
                 elastic_max: int = 8) -> list[Job]:
    """`n_jobs` jobs of pattern `name`; deterministic for a given seed."""
    arrival, mix = split_name(name)
    if n_jobs < 1:
        raise UserError(f"a pattern needs at least 1 job, got {n_jobs}")
    if not load > 0:
        raise UserError(f"load must be > 0, got {load}")
    rng = np.random.default_rng(seed)
    curves = load_throughputs(throughputs)
    batch_models = load_batch_models(throughputs)
    kinds = sorted(curves)
    cap = min(cluster.largest_pool, max_request or cluster.largest_pool)
    kind_idx = rng.integers(0, len(kinds), n_jobs)
    req = rng.choice(_REQ_SIZES, size=n_jobs, p=_REQ_PROBS)
    req = np.minimum(req, cap)
    dur = _durations(rng, mix, n_jobs)
    # offered GPU-seconds per second of arrivals = load x cluster size
    mean_gpu_s = float(np.mean(dur * req))
    mean_gap = mean_gpu_s / (load * cluster.total)
    if arrival == "all-at-once":
        times = np.zeros(n_jobs)
    elif arrival == "poisson":
        times = np.cumsum(rng.exponential(mean_gap, n_jobs))
        times -= times[0]
    else:  # bursts of 4-12 jobs
        times = np.zeros(n_jobs)
        i, t = 0, 0.0
        while i < n_jobs:
            size = int(rng.integers(4, 13))
            times[i:i + size] = t
            t += rng.exponential(mean_gap * size)
            i += size
    jobs: list[Job] = []
    for j in range(n_jobs):
        curve = curves[kinds[kind_idx[j]]]
        # work = duration alone on one GPU of the job's fastest type in this cluster
        best = max(curve.rate(t, 1) for t in cluster.names)
        if best <= 0:  # job type not measured on these GPU types: take the next one that is
            curve = next(curves[k] for k in kinds if max(curves[k].rate(t, 1) for t in cluster.names) > 0)
            best = max(curve.rate(t, 1) for t in cluster.names)
        jobs.append(make_job(j, kinds[kind_idx[j]], float(times[j]), float(dur[j] * best), curve, cluster,
                             requested=int(req[j]), max_gpus=max(int(req[j]), elastic_max),
                             restart_cost=restart_cost, batch_model=batch_models.get(kinds[kind_idx[j]])))
    return jobs
