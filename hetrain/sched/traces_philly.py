"""Philly job runtimes (Microsoft, Jeon et al., ATC '19) as the job-length distribution of
Poisson-arrival workloads.

Input: a one-column CSV ``runtime`` of job runtimes in seconds, as re-published in
alibaba/clusterdata `cluster-trace-gpu-v2020/analysis/philly_runtime.csv` (CC BY 4.0).
The full Philly log (arrivals, GPU counts) is converted by `public_traces` instead.

Rules: runtimes under `MIN_RUNTIME_S` (jobs that failed as they started: a quarter of
the list is 0-60 s) are dropped; each job draws its runtime from the rest (with
replacement), its GPU count from the Philly-like request sizes of the synthetic
patterns (60% one GPU, 20% two, 15% four, 5% eight) and its job type uniformly from
Gavel's measured types; its work is what that type does on its GPU count of its fastest
type in the runtime. Arrivals are Poisson, spaced so the offered GPU-seconds are `load`
times the cluster's capacity.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ..cluster.hardware import Inventory
from ..errors import UserError
from .gavel import load_batch_models, load_throughputs
from .job import Job, make_job
from .patterns import _REQ_PROBS, _REQ_SIZES

MIN_RUNTIME_S = 60.0


class PhillyError(UserError):
    """A Philly runtime file that cannot be used."""


def read_philly_runtimes(path: Path) -> np.ndarray:
    """The runtimes (seconds) of the file, those under MIN_RUNTIME_S dropped."""
    try:
        with Path(path).open(newline="") as fh:
            reader = csv.DictReader(fh)
            if "runtime" not in (reader.fieldnames or []):
                raise PhillyError(f"{path}: a Philly runtime file has a 'runtime' column (seconds); found "
                                  f"{reader.fieldnames}")
            vals = []
            for lineno, row in enumerate(reader, start=2):
                try:
                    vals.append(float(row["runtime"]))
                except (TypeError, ValueError):
                    raise PhillyError(f"{path}:{lineno}: runtime {row['runtime']!r} is not a number of seconds") from None
    except OSError as err:
        raise PhillyError(f"{path}: cannot read the Philly runtimes: {err}") from None
    out = np.array(vals, dtype=float)
    out = out[np.isfinite(out) & (out >= MIN_RUNTIME_S)]
    if not len(out):
        raise PhillyError(f"{path}: no runtime of at least {MIN_RUNTIME_S:.0f} s")
    return out


def philly_workload(runtimes: np.ndarray, n_jobs: int, cluster: Inventory, seed: int = 0, load: float = 1.0,
                    restart_cost: float = 10.0, elastic_max: int = 8, throughputs: str | None = None) -> list[Job]:
    """`n_jobs` Poisson-arrival jobs with Philly runtimes, by the module's rules."""
    if n_jobs < 1:
        raise PhillyError(f"a workload needs at least 1 job, got {n_jobs}")
    if not load > 0:
        raise PhillyError(f"load must be > 0, got {load}")
    rng = np.random.default_rng(seed)
    curves = load_throughputs(throughputs)
    batch = load_batch_models(throughputs)
    kinds = sorted(k for k, c in curves.items() if max(c.rate(t, 1) for t in cluster.names) > 0)
    run = rng.choice(np.asarray(runtimes, dtype=float), size=n_jobs)
    req = np.minimum(rng.choice(_REQ_SIZES, size=n_jobs, p=_REQ_PROBS), cluster.largest_pool)
    kind = rng.integers(0, len(kinds), n_jobs)
    gap = float(np.mean(run * req)) / (load * cluster.total)
    times = np.cumsum(rng.exponential(gap, n_jobs))
    times -= times[0]
    jobs = []
    for j in range(n_jobs):
        curve = curves[kinds[kind[j]]]
        g = int(req[j])
        fits = [t for t, cap in zip(cluster.names, cluster.counts) if cap >= g and curve.rate(t, g) > 0]
        while g > 1 and not fits:
            g //= 2  # no pool runs this type at this size: the largest power of two below that one does
            fits = [t for t, cap in zip(cluster.names, cluster.counts) if cap >= g and curve.rate(t, g) > 0]
        best = max(curve.rate(t, g) for t in (fits or cluster.names))
        jobs.append(make_job(j, kinds[kind[j]], float(times[j]), float(run[j] * best), curve, cluster, requested=g,
                             max_gpus=max(g, elastic_max), restart_cost=restart_cost, batch_model=batch.get(kinds[kind[j]])))
    return jobs
