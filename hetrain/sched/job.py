"""A schedulable job: work to do, how fast it goes on each GPU type and count, bounds
on its size, and what a stop/restart costs. Rates come from `hetrain.perf.jobs`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..cluster.hardware import Inventory
from ..errors import UserError
from ..perf.goodput import BatchModel
from ..perf.jobs import ScalingCurve, completion_time, rate_table


class Alloc(NamedTuple):
    """`n` GPUs of the cluster's type number `type` (a job never mixes types in one ring)."""

    type: int
    n: int


Allocation = dict[int, Alloc]  # job_id -> Alloc; absent means no GPUs (waiting)


class JobError(UserError):
    """A job that cannot run on the cluster."""


@dataclass
class Job:
    job_id: int
    name: str
    arrival: float
    work: float                   # total work units
    rates: np.ndarray             # rates[type, g], work units / s, column 0 is zero
    requested: int = 1            # GPUs asked for (fifo / srtf give this)
    min_gpus: int = 1
    max_gpus: int = 8
    restart_cost: float = 10.0    # seconds lost per stop + restart
    remaining: float = field(default=-1.0)
    started: bool = False         # has run before: a new size costs a restart
    restarts: int = 0             # restarts so far (Sia's restart penalty reads it)
    estimate: float | None = None  # the user's estimate of the total work, if any (lengths unknown)
    attained: float = 0.0         # work done so far (all of it once finished): what a scheduler observes
    length_known: bool = False    # `remaining` is the truth (told), not an estimate
    start_cost: float = 0.0       # seconds before the first step of a cold start
    # seconds the job has held GPUs of each type (kept by the simulator and the executor;
    # Gavel's round-based mechanism compares it with the time shares its LP asks for)
    service_s: np.ndarray = field(default=None, repr=False)
    # goodput (`hetrain.perf.goodput`): rates[type, g] at the best batch for each size and
    # that batch; None for a job whose batch cannot change. `rates` is what policies see:
    # the base rates (fixed batch) or these (`use_goodput`); `base_rates` keeps the former.
    goodput_rates: np.ndarray | None = field(default=None, repr=False)
    batch_table: np.ndarray | None = field(default=None, repr=False)
    base_batch: int = 0
    base_rates: np.ndarray = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.remaining < 0:
            self.remaining = self.work
        if self.base_rates is None:
            self.base_rates = self.rates
        if self.service_s is None:
            self.service_s = np.zeros(self.rates.shape[0])
        self.max_gpus = min(self.max_gpus, self.rates.shape[1] - 1)

    def rate(self, a: Alloc | None) -> float:
        if a is None or a.n <= 0 or a.n > self.max_gpus:
            return 0.0
        return float(self.rates[a.type, a.n])

    def batch_for(self, a: Alloc | None) -> int:
        """The global batch the job runs at on `a`: the best one when goodput is in play,
        else its base batch (0: the job did not say)."""
        if a is None or self.batch_table is None or self.rates is self.base_rates:
            return self.base_batch
        return int(self.batch_table[a.type, a.n]) or self.base_batch

    def feasible_n(self, t: int, n: int) -> int:
        """Largest count <= n that runs on type t (0 if none down to min_gpus)."""
        n = min(n, self.max_gpus)
        while n >= self.min_gpus and self.rates[t, n] <= 0:
            n -= 1
        return n if n >= self.min_gpus else 0

    def est_time(self, a: Alloc, current: Alloc | None) -> float:
        """Estimated seconds to finish from now at allocation a (restart charged on a change)."""
        return completion_time(self.remaining, self.rate(a), self.change_cost(a, current))

    def change_cost(self, a: Alloc | None, current: Alloc | None) -> float:
        """Seconds a move from `current` to `a` costs: the restart cost, once the job has run."""
        return self.restart_cost if (self.started and a != current) else 0.0

    def best_type_order(self, n: int) -> list[int]:
        """Types sorted fastest first for this job at n GPUs (or at its feasible size)."""
        col = self.rates[:, min(max(n, 1), self.rates.shape[1] - 1)]
        return [int(i) for i in np.argsort(-col, kind="stable")]


PRIOR_GPU_S = 3600.0  # a job not yet run, without a user's estimate, is assumed one GPU-hour long


def length_estimate(job: Job, done: float) -> float:
    """The remaining work a scheduler that is not told lengths assumes, from what the job
    itself shows: its user's estimate while the job is within it, else as much again as
    it has done (in heavy-tailed workloads, such as Philly's, a job that has run long is
    likely to run long: the expected remainder grows with the age), and at least the
    prior: PRIOR_GPU_S of work on one GPU of its fastest type. Shortest-estimate-first
    on this is least-attained-service first among jobs past the prior (Tiresias)."""
    prior = PRIOR_GPU_S * float(job.base_rates[:, 1].max()) if job.base_rates.shape[1] > 1 else 0.0
    if job.estimate is not None and job.estimate > done:
        return float(job.estimate - done)
    return max(float(done), prior, 1e-9)


def restart_factor(job: Job, now: float) -> float:
    """Pollux's re-allocation factor (OSDI '21), which Sia adopts: a running job's value on
    any configuration but its current one is scaled by max(0, (age - restarts x delta) /
    (age + delta)), delta its restart cost, so a young or often-restarted job is kept put
    (1 for a job that never ran)."""
    if not job.started:
        return 1.0
    age = max(0.0, now - job.arrival)
    delta = max(job.restart_cost, 1e-9)
    return max(0.0, (age - job.restarts * delta) / (age + delta))


def use_goodput(jobs, on: bool) -> None:
    """Let policies see each job's goodput at its best batch (on) or its base-batch
    rates (off). A batch-adapting policy is run with it on, every other with it off."""
    for j in jobs:
        j.rates = j.goodput_rates if (on and j.goodput_rates is not None) else j.base_rates


def make_job(job_id: int, name: str, arrival: float, work: float, curve: ScalingCurve,
             cluster: Inventory, requested: int = 1, min_gpus: int = 1, max_gpus: int | None = None,
             restart_cost: float = 10.0, where: str = "", batch_model: BatchModel | None = None) -> Job:
    """Bind a job to a cluster (dense rate table) and check it can run there at all;
    with a batch model, also its goodput table (work counted in base-batch steps)."""
    at = f"{where}: " if where else ""
    if requested < 1 or min_gpus < 1:
        raise JobError(f"{at}job {name!r} must ask for at least 1 GPU (asked {requested}, min {min_gpus})")
    if requested > cluster.largest_pool:
        raise JobError(f"{at}job {name!r} asks for {requested} GPUs but the largest GPU pool of "
                       f"cluster {cluster.spec} has {cluster.largest_pool}; ask for fewer or add GPUs")
    if work <= 0:
        raise JobError(f"{at}job {name!r} needs positive work, got {work}")
    top = max(curve.max_gpus(t) for t in cluster.names)
    cap = cluster.largest_pool if max_gpus is None else min(max_gpus, cluster.largest_pool)
    table = rate_table(curve, cluster.names, max(1, min(top, cap)))
    if not np.any(table[:, min_gpus:] > 0) or min_gpus > table.shape[1] - 1:
        raise JobError(f"{at}job {name!r} cannot run on any GPU type of cluster {cluster.spec} "
                       f"with >= {min_gpus} GPUs (no measured throughput)")
    if min_gpus > requested:
        raise JobError(f"{at}job {name!r}: min_gpus {min_gpus} is larger than the {requested} GPUs asked for")
    good, batch = batch_model.goodput_table(table, cluster.names) if batch_model else (None, None)
    return Job(job_id, name, float(arrival), float(work), table, requested=requested, min_gpus=min_gpus,
               max_gpus=table.shape[1] - 1, restart_cost=float(restart_cost), goodput_rates=good,
               batch_table=batch, base_batch=batch_model.base_batch if batch_model else 0)


def mean_jct(jobs_finish: dict[int, float], jobs: list[Job]) -> float:
    return float(np.mean([jobs_finish[j.job_id] - j.arrival for j in jobs]))


@dataclass
class RealJobSpec:
    """A job the real executor runs (`hetrain.sched.executor`): a small training job
    whose compute is emulated, arriving at `arrival` seconds into the workload."""

    name: str
    arrival: float
    steps: int
    compute_s: float          # emulated compute of one global batch on one GPU of speed 1
    batch: int = 32           # base batch: steps, compute_s count at it
    seed: int = 0
    max_gpus: int = 2
    max_batch: int = 0        # > batch: a goodput-aware policy may run the job at up to this batch
    noise_scale: float = float("inf")  # assumed until the workers measure it
