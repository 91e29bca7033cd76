"""First come, first served, no preemption: each job gets the GPUs it asked for (on
its fastest GPU type with room) in arrival order; the head of the queue blocks the rest."""
from __future__ import annotations

from ..job import Alloc
from .base import register


@register("fifo")
def fifo(jobs, cluster, allocation, now):
    free = cluster.capacity.copy()
    out = dict(allocation)
    for a in allocation.values():
        free[a.type] -= a.n
    for job in sorted((j for j in jobs if j.job_id not in allocation), key=lambda j: (j.arrival, j.job_id)):
        placed = False
        for t in job.best_type_order(job.requested):
            n = job.feasible_n(t, job.requested)
            if n and free[t] >= n:
                out[job.job_id] = Alloc(t, n)
                free[t] -= n
                placed = True
                break
        if not placed:
            break  # strict FIFO: the head of the queue waits and so does everyone behind it
    return out
