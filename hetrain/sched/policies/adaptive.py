"""hetrain's default policy: the doubling heuristic made queue- and type-aware.

1. Admission in SRPT order: jobs are admitted (at their minimum size) shortest
   estimated remaining time first, running or not, until no pool has room for the next
   one's minimum; a running job that loses its place pays its restart cost when it
   comes back, which its estimate includes. Under load this finishes short jobs first,
   as SRTF does, instead of sharing the cluster among the oldest jobs.
2. Growth by doubling, as in the paper (`doubling.grow`).
3. Local search on the same objective (the sum of estimated completion times, restart
   costs charged): a job may move to another GPU type or size using GPUs that growth
   left idle there (relocation), or two jobs on different types may trade places
   (swap), whichever gains most; the GPUs freed go back to growth. Repeated until no
   move gains (at most 16 moves a decision). This is what doubling cannot do: a job's type is fixed at admission,
   so a pool can sit idle while a job that would run well there waits for a doubling
   in a full one, and two jobs can each sit on the other's better type.
"""
from __future__ import annotations

import numpy as np

from ...perf.jobs import completion_time
from ..job import Alloc
from .base import admit_at_minimum, register
from .doubling import grow

SWAP_CANDIDATES = 32  # jobs (those that could gain most elsewhere) whose swap partners are sought
_EPS = 1e-9


def relocate(jobs, cluster, allocation, tent, free, max_moves: int | None = None):
    """Move jobs to better (type, size) options that fit in the idle GPUs, then re-grow."""
    by_id = {j.job_id: j for j in jobs}
    ids = [jid for jid in tent]
    if not ids or len(cluster.names) < 1:
        return tent
    nt = len(cluster.names)
    width = max(by_id[j].rates.shape[1] for j in ids)
    rates = np.zeros((len(ids), nt, width))
    pen = np.zeros(len(ids))
    rem = np.zeros(len(ids))
    mins = np.zeros(len(ids), dtype=np.int64)
    maxs = np.zeros(len(ids), dtype=np.int64)
    cur_t = np.full(len(ids), -1)
    cur_n = np.full(len(ids), -1)
    for i, jid in enumerate(ids):
        j = by_id[jid]
        rates[i, :, :j.rates.shape[1]] = j.rates
        pen[i] = j.restart_cost if j.started else 0.0
        rem[i] = j.remaining
        mins[i], maxs[i] = j.min_gpus, j.max_gpus
        cur = allocation.get(jid)
        if cur is not None:
            cur_t[i], cur_n[i] = cur.type, cur.n
    ks = np.arange(width)
    same = (ks[None, None, :] == cur_n[:, None, None]) & (np.arange(nt)[None, :, None] == cur_t[:, None, None])
    cost = completion_time(rem[:, None, None], rates, np.where(same, 0.0, pen[:, None, None]))
    ok = (ks[None, None, :] >= mins[:, None, None]) & (ks[None, None, :] <= maxs[:, None, None])
    cost = np.where(ok, cost, np.inf)
    # best[i, t, k]: the job's lowest cost on type t with at most k GPUs, and that size
    best = np.minimum.accumulate(cost, axis=2)
    best_n = np.maximum.accumulate(np.where(cost <= best, ks[None, None, :], 0), axis=2)
    rows = np.arange(len(ids))
    moves = 0
    limit = max_moves if max_moves is not None else min(2 * len(ids), 16)
    while moves < limit:
        t_now = np.array([tent[jid].type for jid in ids])
        n_now = np.array([tent[jid].n for jid in ids])
        now_cost = cost[rows, t_now, n_now]
        # relocation: the idle GPUs of a type, plus the job's own on its type
        avail = np.broadcast_to(free[None, :], (len(ids), nt)).copy()
        avail[rows, t_now] += n_now
        avail = np.minimum(avail, width - 1)
        reloc = now_cost[:, None] - best[rows[:, None], np.arange(nt)[None, :], avail]
        i, t = np.unravel_index(int(np.argmax(reloc)), reloc.shape)
        move = [(i, t, int(best_n[i, t, avail[i, t]]))] if reloc[i, t] > _EPS * max(1.0, now_cost[i]) else []
        gain = reloc[i, t] if move else 0.0
        if nt > 1:
            # swap: a takes b's type (b's GPUs and the idle ones) and b takes a's. Pairs are
            # sought for the SWAP_CANDIDATES jobs that could gain most on another type,
            # with every job as partner: O(candidates x jobs) instead of O(jobs^2)
            room = np.minimum(free[t_now] + n_now, width - 1)   # a type's GPUs once this job leaves
            upper = now_cost - best[rows, :, width - 1].min(axis=1)
            cand = np.argsort(-upper, kind="stable")[:SWAP_CANDIDATES]
            cap_a = np.broadcast_to(room[None, :], (len(cand), len(ids)))  # a on b's type
            cap_b = np.broadcast_to(room[cand][:, None], (len(cand), len(ids)))  # b on a's type
            c_a = best[cand[:, None], t_now[None, :], cap_a]
            c_b = best[rows[None, :], t_now[cand][:, None], cap_b]
            sw = now_cost[cand][:, None] + now_cost[None, :] - c_a - c_b
            sw[t_now[cand][:, None] == t_now[None, :]] = -np.inf
            k, b = np.unravel_index(int(np.argmax(sw)), sw.shape)
            a = int(cand[k])
            if sw[k, b] > max(gain, _EPS * max(1.0, now_cost[a] + now_cost[b])):
                move = [(a, t_now[b], int(best_n[a, t_now[b], cap_a[k, b]])),
                        (b, t_now[a], int(best_n[b, t_now[a], cap_b[k, b]]))]
        if not move:
            break
        touched = set()
        for i, t, _ in move:
            old = tent[ids[i]]
            free[old.type] += old.n
            touched.add(old.type)
        for i, t, n in move:
            free[t] -= n
            tent[ids[i]] = Alloc(int(t), int(n))
        moves += 1
        grow(by_id, tent, free, allocation, top_up=True, types=touched)
    return tent


def plan(jobs, cluster, allocation, now):
    tent, free = admit_at_minimum(jobs, cluster, allocation, order="srpt")
    by_id = {j.job_id: j for j in jobs}
    grow(by_id, tent, free, allocation, top_up=True)
    return relocate(jobs, cluster, allocation, tent, free)


@register("adaptive")
def adaptive(jobs, cluster, allocation, now):
    return plan(jobs, cluster, allocation, now)


def _adaptive_goodput(jobs, cluster, allocation, now):
    return plan(jobs, cluster, allocation, now)


# the same heuristic on goodput rates, jobs run at their best batch: a peer that isolates
# what the goodput policy's integer program adds over the heuristic
_adaptive_goodput.adapts_batch = True
register("adaptive-goodput")(_adaptive_goodput)
