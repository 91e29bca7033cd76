"""The paper's doubling heuristic, extended to several GPU types (hetrain's default,
`adaptive`, builds on its growth step).

1. Admission: every job gets its minimum size (running jobs first, keeping their type;
   then waiting jobs in arrival order), each new job on the type it is relatively best
   at (`admit_at_minimum`).
2. Growth: repeatedly double the job whose estimated completion time drops most per
   added GPU, within its type's pool, until no doubling gains anything or GPUs run out.
   When a pool no longer has room for a full doubling, the job may take what is left
   (`top_up`). Completion estimates charge the job's restart cost whenever its size or
   type would differ from what it runs with now, so the heuristic resizes a running job
   only when that pays for the stop/restart.

A max-heap of one candidate move per job makes a re-plan O((jobs + GPUs) log jobs): a
pool's free count only falls during growth, so a move that no longer fits is re-priced
once (smaller) or dropped, never revisited.
"""
from __future__ import annotations

import heapq

from ..job import Alloc
from .base import admit_at_minimum, register


def _move(job, a, free_t, current, top_up):
    """Best next size for a job at `a` and its score (gain in seconds per added GPU).

    Candidates are the repeated doublings 2n, 4n, ... that fit the pool (looking past
    one doubling matters for measured curves that dip, e.g. Gavel's LM jobs run slower
    on 4 V100s than on 2 but far faster on 8), plus with `top_up` whatever is left in
    the pool when a full doubling no longer fits.
    """
    limit = min(job.max_gpus, a.n + int(free_t))
    cands = []
    t = 2 * a.n
    while t <= limit:
        cands.append(t)
        t *= 2
    if top_up and limit > a.n and (not cands or cands[-1] < limit) and 2 * a.n > limit:
        cands.append(limit)
    before = job.est_time(a, current)
    best = None
    for target in cands:
        if job.rates[a.type, target] <= 0:
            continue
        gain = before - job.est_time(Alloc(a.type, target), current)
        if gain > 0:
            score = gain / (target - a.n)
            if best is None or score > best[0]:
                best = (score, target)
    return best


def plan(jobs, cluster, allocation, now, top_up=True, order="arrival"):
    tent, free = admit_at_minimum(jobs, cluster, allocation, order=order)
    return grow({j.job_id: j for j in jobs}, tent, free, allocation, top_up)


def grow(by_id, tent, free, allocation, top_up=True, types=None):
    """Doubling growth of a tentative allocation (`tent` and `free` are updated in place);
    with `types`, only jobs on those GPU types are considered (the pools that gained GPUs)."""
    heap = []
    for jid, a in tent.items():
        if free[a.type] <= 0 or (types is not None and a.type not in types):
            continue  # nothing to grow into
        mv = _move(by_id[jid], a, free[a.type], allocation.get(jid), top_up)
        if mv:
            heap.append((-mv[0], jid, mv[1]))
    heapq.heapify(heap)
    while heap:
        neg, jid, target = heapq.heappop(heap)
        a = tent[jid]
        job = by_id[jid]
        cur = allocation.get(jid)
        if target - a.n > free[a.type]:  # pool shrank since this move was priced: re-price
            mv = _move(job, a, free[a.type], cur, top_up)
            if mv:
                heapq.heappush(heap, (-mv[0], jid, mv[1]))
            continue
        free[a.type] -= target - a.n
        a = tent[jid] = Alloc(a.type, target)
        mv = _move(job, a, free[a.type], cur, top_up)
        if mv:
            heapq.heappush(heap, (-mv[0], jid, mv[1]))
    return tent


@register("doubling")
def doubling(jobs, cluster, allocation, now):
    return plan(jobs, cluster, allocation, now, top_up=True)


@register("doubling-strict")
def doubling_strict(jobs, cluster, allocation, now):
    """The paper's rule exactly: sizes only double (GPUs a doubling cannot use stay idle)."""
    return plan(jobs, cluster, allocation, now, top_up=False)

