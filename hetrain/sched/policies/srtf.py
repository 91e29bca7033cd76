"""Shortest remaining time first (preemptive, with backfilling): the peer baseline most
JCT-minded schedulers compare against. Jobs get the GPUs they asked for, in order of
their remaining time at that size on their fastest type; a job that does not fit is
skipped, so smaller ones behind it can run. Running jobs keep their type when it has room."""
from __future__ import annotations

from ...perf.jobs import completion_time
from ..job import Alloc
from .base import register


@register("srtf")
def srtf(jobs, cluster, allocation, now):
    free = cluster.capacity.copy()

    def key(job):
        n = job.requested
        best = max(job.rates[t, job.feasible_n(t, n)] for t in range(len(cluster.names)))
        return (completion_time(job.remaining, best), job.arrival, job.job_id)

    out = {}
    for job in sorted(jobs, key=key):
        cur = allocation.get(job.job_id)
        order = job.best_type_order(job.requested)
        if cur is not None:
            order = [cur.type] + [t for t in order if t != cur.type]
        for t in order:
            n = job.feasible_n(t, job.requested)
            if n and free[t] >= n:
                out[job.job_id] = Alloc(t, n)
                free[t] -= n
                break
    return out


srtf.oracle = True  # type: ignore[attr-defined]  # an oracle yardstick: told true remaining times
