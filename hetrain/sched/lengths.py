"""How long a job has left, for a scheduler that is not told job lengths: the mean
residual length under the distribution learned from the jobs that finished.

A production scheduler sees two things about lengths: how much work each running job
has done (its attained service) and how much every finished job did. From these it can
estimate the size distribution S and price a job that has done a units of work by its
expected remaining work E[S - a | S > a] (the mean residual life). That one number adapts
the order of the jobs to the workload, with no knob: where sizes are light-tailed (a
job that ran a while is nearly done) it favours the oldest jobs, which then run to
completion instead of sharing the cluster round-robin; where sizes are heavy-tailed (the
longer a job has run, the longer it will) it favours the least-served (as Tiresias,
NSDI '19, with its Gittins policy on the past jobs' distribution); for a mix of short
and long jobs it favours a job while it is probably a short one.

The distribution is the Kaplan-Meier estimate over the finished jobs' sizes (events)
and the active jobs' attained service (censored: they are known to be at least that
long), so early on, when only short jobs have finished, the long running ones still
weigh. The mass Kaplan-Meier leaves beyond the longest finished job is placed at twice
the larger of that length and the job's own attained service (as much again: the
heavy-tail prior of `job.length_estimate`). Sizes are normalised per job to seconds on
one GPU of its fastest type at its base batch (`work_unit`).

Before `MIN_FINISHED` jobs have finished, the estimate is `job.remaining` as the
simulator or executor set it: the truth when told, else `job.length_estimate` (the
user's estimate, or as much again as done, at least one GPU-hour).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .job import Job

MIN_FINISHED = 3     # finished jobs before the learned distribution replaces the prior rule
WINDOW = 2000        # the most recent finished jobs kept (a workload's mix may drift)


def work_unit(job: Job) -> float:
    """Work units one GPU of the job's fastest type does per second at its base batch
    (the best per-GPU rate when the job cannot run on one GPU)."""
    r = job.base_rates
    if r.shape[1] < 2:
        return 1.0
    best = float((r[:, 1:] / np.arange(1, r.shape[1])[None, :]).max())
    return best if best > 0 else 1.0


def kaplan_meier(sizes: np.ndarray, censored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Kaplan-Meier estimate from finished sizes (events) and lower bounds (censored):
    (event points ascending, probability mass at each). The mass left over (the survival
    past the last event) belongs to sizes beyond every event, wherever they are."""
    t = np.concatenate([sizes, censored])
    event = np.concatenate([np.ones(len(sizes), dtype=bool), np.zeros(len(censored), dtype=bool)])
    order = np.lexsort((~event, t))  # by time; at a tie the event first (a censored job outlived it)
    t, event = t[order], event[order]
    at_risk = len(t) - np.arange(len(t))
    surv = np.cumprod(np.where(event, 1.0 - 1.0 / at_risk, 1.0))
    before = np.concatenate([[1.0], surv[:-1]])
    return t[event], (before - surv)[event]


def mean_residual(attained: np.ndarray, points: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """E[S - a | S > a] for each attained service a, over the discrete distribution
    (points ascending, mass) with the leftover mass 1 - sum(mass) at 2 max(last point, a);
    NaN where nothing lies above a (no points and no leftover mass)."""
    a = np.asarray(attained, dtype=float)
    if not len(points):
        return np.full(len(a), np.nan)
    k = np.searchsorted(points, a, side="right")  # the points above a are points[k:]
    m_above = np.concatenate([np.cumsum(mass[::-1])[::-1], [0.0]])[k]
    ms_above = np.concatenate([np.cumsum((mass * points)[::-1])[::-1], [0.0]])[k]
    tail = max(0.0, 1.0 - float(mass.sum()))
    tail_at = 2.0 * np.maximum(points[-1], a)
    den = m_above + tail
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (ms_above + tail * tail_at) / den - a
    return np.where(den > 1e-12, out, np.nan)


class LengthModel:
    """The policy's view of job lengths: learns from the jobs it saw finish and prices
    every active job by its mean residual length (module docstring). Fed by `observe`,
    which reads only what a production scheduler sees: the active jobs' attained work
    and, for a job no longer active, the work it had done when it finished."""

    def __init__(self, min_finished: int = MIN_FINISHED, window: int = WINDOW) -> None:
        self.min_finished = min_finished
        self.window = window
        self.finished: list[float] = []    # normalised sizes of the jobs that finished
        self._seen: dict[int, Job] = {}    # the jobs active at the last decision

    def observe(self, jobs: Sequence[Job]) -> None:
        """Record the jobs that were active at the last decision and are gone now (finished:
        the simulator and the executor set `attained` to the work done at the end)."""
        ids = {j.job_id for j in jobs}
        for jid, job in self._seen.items():
            if jid not in ids and job.attained > 0:
                self.finished.append(job.attained / work_unit(job))
        del self.finished[:-self.window]
        self._seen = {j.job_id: j for j in jobs}

    def remaining(self, jobs: Sequence[Job]) -> np.ndarray:
        """Each job's remaining work (its units) as the policy should price it: the mean
        residual length under the learned distribution for a job whose length is not
        known (and that has no user's estimate it is still within); else `job.remaining`,
        which the simulator and the executor set to the truth when told, else to the
        prior rule (`job.length_estimate`)."""
        rem = np.array([j.remaining for j in jobs], dtype=float)
        if len(self.finished) < self.min_finished:
            return rem
        idx = np.array([i for i, j in enumerate(jobs) if not j.length_known
                        and not (j.estimate is not None and j.estimate > j.attained)], dtype=np.int64)
        if not len(idx):
            return rem
        unit = np.array([work_unit(jobs[i]) for i in idx])
        att = np.array([jobs[i].attained for i in idx]) / unit
        points, mass = kaplan_meier(np.asarray(self.finished), att[att > 0])
        eff = mean_residual(att, points, mass)
        rem[idx] = np.where(np.isnan(eff), rem[idx], np.maximum(eff * unit, 1e-9))
        return rem
