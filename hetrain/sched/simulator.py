"""Discrete-event simulator of a GPU cluster under a scheduling policy.

Events are job arrivals and completions (and, for a round-based policy such as Gavel's,
the start of every round); all events at one instant are applied, then the policy
re-plans once. A job whose allocation changes after it has started (a
resize, a type change, or a resume after preemption) pauses for its restart cost
before it progresses again: that is the stop/restart charge. Progress between events
is `rate(type, n) x time`, integrated with numpy over the active jobs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from ..cluster.hardware import Inventory
from .job import Allocation, Job, length_estimate, use_goodput
from .policies import Policy, check_allocation, get_policy

_EPS = 1e-9


@dataclass
class SimResult:
    policy: str
    cluster: str
    arrival: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    restarts_per_job: np.ndarray
    makespan_s: float
    utilization: float
    decisions: int
    decision_wall_s: float
    wall_s: float
    timeline_t: np.ndarray = field(repr=False)      # event times
    timeline_used: np.ndarray = field(repr=False)   # GPUs in use per type after each event
    timeline_running: np.ndarray = field(repr=False)
    gpu_types: tuple[str, ...] = ()

    @property
    def jct(self) -> np.ndarray:
        return self.finish - self.arrival

    @property
    def avg_jct_s(self) -> float:
        return float(self.jct.mean())

    @property
    def p99_jct_s(self) -> float:
        return float(np.percentile(self.jct, 99))

    @property
    def restarts(self) -> int:
        return int(self.restarts_per_job.sum())

    def summary(self) -> dict:
        return {"policy": self.policy, "cluster": self.cluster, "jobs": int(len(self.jct)),
                "avg_jct_s": self.avg_jct_s, "p50_jct_s": float(np.median(self.jct)),
                "p99_jct_s": self.p99_jct_s, "makespan_s": self.makespan_s,
                "utilization": self.utilization, "restarts": self.restarts, "decisions": self.decisions,
                "decision_ms": 1e3 * self.decision_wall_s / max(1, self.decisions), "wall_s": self.wall_s}


def _reset_jobs(jobs: Sequence[Job], cluster: Inventory, pol: Policy) -> None:
    """Fresh scheduler state on every job: not started, no GPU time held; a batch-adapting
    policy sees goodput rates, any other the base rates."""
    use_goodput(jobs, getattr(pol, "adapts_batch", False))
    for j in jobs:
        j.started = False
        j.restarts = 0
        j.attained = 0.0
        j.service_s = np.zeros(len(cluster.names))


def _completion_times(act: np.ndarray, now: float, rate: np.ndarray, rem: np.ndarray,
                      pause_until: np.ndarray) -> tuple[np.ndarray, float]:
    """When each active job would finish at its current rate (after any pause), and the
    earliest of them; a job with no GPUs (rate 0) never finishes on its own."""
    if not len(act):
        return np.zeros(0), np.inf
    r = rate[act]
    begin = np.maximum(now, pause_until[act])
    with np.errstate(divide="ignore"):
        t_done = np.where(r > 0, begin + rem[act] / np.where(r > 0, r, 1.0), np.inf)
    return t_done, float(t_done.min())


def _apply_changes(jobs: Sequence[Job], idx_of: dict[int, int], alloc: Allocation, new: Allocation, now: float,
                   rate: np.ndarray, pause_until: np.ndarray, start: np.ndarray, restarts: np.ndarray) -> None:
    """Apply a decision's changed allocations: a job given GPUs for the first time pauses
    for its cold-start cost, a started job whose allocation changed pauses for its restart
    cost (the stop/restart charge), and a job left without GPUs stops progressing."""
    for jid in set(alloc) | set(new):
        old_a, new_a = alloc.get(jid), new.get(jid)
        if old_a == new_a:
            continue
        i = idx_of[jid]
        job = jobs[i]
        if new_a is None:
            rate[i] = 0.0
            continue
        if job.started:
            restarts[i] += 1
            job.restarts += 1
            pause_until[i] = now + job.restart_cost
        else:
            job.started = True
            start[i] = now
            pause_until[i] = now + job.start_cost
        rate[i] = job.rate(new_a)


def _retire(done: np.ndarray, now: float, jobs: Sequence[Job], alloc: Allocation, active: set[int],
            used: np.ndarray, rem: np.ndarray, finish: np.ndarray, rate: np.ndarray) -> None:
    """Mark the jobs in `done` finished at `now`: they leave the active set and give back
    their GPUs, so the next decision can hand those to the jobs still waiting."""
    for i in done.tolist():
        rem[i] = 0.0
        finish[i] = now
        active.discard(i)
        jobs[i].attained = jobs[i].work  # a finished job's length is known from now on
        a = alloc.pop(jobs[i].job_id, None)
        if a is not None:
            used[a.type] -= a.n
        rate[i] = 0.0


Lengths = Literal["unknown", "known"]


def simulate(jobs: Sequence[Job], cluster: Inventory, policy: Policy | str, progress: bool = False,
             validate: bool = True, lengths: Lengths = "unknown") -> SimResult:
    """Run `jobs` (fresh Job objects; their `remaining` is consumed) to completion.

    lengths="unknown" (default, as in production): a policy sees as each job's
    `remaining` only `job.length_estimate` (its user's estimate or its own progress), not
    its true remaining work, unless it is flagged `oracle` (srtf and the per-decision
    optima: yardsticks that are told). "known" tells every policy."""
    pol = get_policy(policy) if isinstance(policy, str) else policy
    if hasattr(pol, "fresh"):
        pol = pol.fresh()  # no state (GPU prices, learned lengths) carried over from another run
    name = policy if isinstance(policy, str) else getattr(policy, "policy_name", getattr(policy, "__name__", "?"))
    t_wall = time.perf_counter()
    n = len(jobs)
    order = sorted(range(n), key=lambda i: (jobs[i].arrival, jobs[i].job_id))
    arrival = np.array([j.arrival for j in jobs])
    rem = np.array([j.remaining for j in jobs], dtype=float)
    rate = np.zeros(n)
    pause_until = np.full(n, -np.inf)
    start = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    restarts = np.zeros(n, dtype=np.int64)
    _reset_jobs(jobs, cluster, pol)
    round_s = getattr(pol, "round_s", None)
    told = lengths == "known" or getattr(pol, "oracle", False)
    idx_of = {j.job_id: i for i, j in enumerate(jobs)}
    if len(idx_of) != n:
        raise ValueError("job ids must be unique")
    active: set[int] = set()
    alloc: Allocation = {}
    ntypes = len(cluster.names)
    used = np.zeros(ntypes, dtype=np.int64)
    tl_t, tl_used, tl_run = [], [], []
    busy_gpu_s = 0.0
    decisions, decision_s = 0, 0.0
    ai = 0
    now = float(arrival[order[0]]) if n else 0.0
    t0 = now
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n, unit="job", desc=f"simulate {name}", leave=False)
    while ai < n or active:
        act = np.fromiter(active, dtype=np.int64, count=len(active))
        t_arr = float(arrival[order[ai]]) if ai < n else np.inf
        t_done, t_comp = _completion_times(act, now, rate, rem, pause_until)
        # round-based policies (Gavel) also re-plan every round while jobs are active
        t_round = now + round_s if round_s and len(act) else np.inf
        t_next = min(t_arr, t_comp, t_round)
        if not np.isfinite(t_next):
            raise RuntimeError(f"policy {name} left {len(active)} jobs waiting on an idle cluster at t={now:.0f}s "
                               f"(no job can start); this is a policy bug or an impossible request")
        # progress up to t_next
        if len(act):
            busy_gpu_s += float(used.sum()) * (t_next - now)
            run_dt = np.clip(t_next - np.maximum(now, pause_until[act]), 0.0, None)
            rem[act] -= rate[act] * run_dt
            for jid, a in alloc.items():
                jobs[idx_of[jid]].service_s[a.type] += t_next - now
            done = act[t_done <= t_next + _EPS * max(1.0, abs(t_next))]
        else:
            done = act
        now = t_next
        _retire(done, now, jobs, alloc, active, used, rem, finish, rate)
        if bar is not None and len(done):
            bar.update(len(done))
        while ai < n and arrival[order[ai]] <= now:
            active.add(order[ai])
            ai += 1
        if not active:
            tl_t.append(now), tl_used.append(used.copy()), tl_run.append(0)
            continue
        # re-plan
        act_jobs = [jobs[i] for i in active]
        for j in act_jobs:
            left = float(rem[idx_of[j.job_id]])
            j.attained = j.work - left
            j.length_known = told
            j.remaining = left if told else length_estimate(j, j.attained)
        t_dec = time.perf_counter()
        new = pol(act_jobs, cluster, alloc, now)
        decision_s += time.perf_counter() - t_dec
        decisions += 1
        if validate:
            check_allocation(act_jobs, cluster, new)
        _apply_changes(jobs, idx_of, alloc, new, now, rate, pause_until, start, restarts)
        alloc = dict(new)
        used[:] = 0
        for a in alloc.values():
            used[a.type] += a.n
        tl_t.append(now), tl_used.append(used.copy()), tl_run.append(len(alloc))
    if bar is not None:
        bar.close()
    makespan = float(np.nanmax(finish) - t0) if n else 0.0
    util = busy_gpu_s / (cluster.total * makespan) if makespan > 0 else 0.0
    return SimResult(policy=name, cluster=cluster.spec, arrival=arrival, start=start, finish=finish,
                     restarts_per_job=restarts, makespan_s=makespan, utilization=util, decisions=decisions,
                     decision_wall_s=decision_s, wall_s=time.perf_counter() - t_wall,
                     timeline_t=np.array(tl_t), timeline_used=np.array(tl_used).reshape(-1, ntypes),
                     timeline_running=np.array(tl_run), gpu_types=cluster.names)
