"""What a real job reports while it runs, and what the executor keeps of each job.

Rank 0 of a job (`hetrain.sched.worker`) rewrites one `progress` file after every step;
the executor polls it to time stops and starts, to collect step samples for the fit and
to learn when a job's work is done. Kept apart from the executor's loop so that the
record of a job (`JobRun`) and the way its measurements are read can be found in one
place.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..perf.jobs import JobFit, RingCurve, StepSample
from .job import Alloc, Job, RealJobSpec


@dataclass(frozen=True)
class Progress:
    """The fields of a job's `progress` file, as rank 0 writes them after each step."""

    step: int = 0
    time: float = 0.0       # wall clock of the step's end
    world: int = 0
    timed: int = 0          # steps of the current run after its first
    compute_s: float = 0.0  # their summed compute seconds (rank 0)
    comm_s: float = 0.0     # their summed communication seconds
    work: float = 0.0       # base-batch steps of work done (statistical efficiency counted)
    batch: int = 0          # this run's global batch
    noise_scale: float = float("inf")  # as the workers measure it


def read_progress(d: Path) -> Progress:
    """The job's last progress line; all zeros before its first step (or a torn read)."""
    try:
        f = (d / "progress").read_text().split()
        return Progress(int(f[0]), float(f[1]), int(f[2]), int(f[3]), float(f[4]), float(f[5]),
                        float(f[6]), int(f[7]), float(f[8]))
    except (OSError, ValueError, IndexError):
        return Progress()


@dataclass
class JobRun:
    """One job of a real workload: its spec and scheduler view, the launcher running it, the
    allocation it runs at and the one it should move to, and its measurements."""

    spec: RealJobSpec
    job: Job
    dir: Path
    prior: RingCurve
    proc: subprocess.Popen | None = None
    alloc: Alloc | None = None
    target: Alloc | None = None
    stopping_since: float | None = None
    launched_at: float | None = None
    launch_step: int = 0
    pending_cost: float | None = None   # stop duration, to add to the restart's start time
    first_launch: bool = True
    finish: float | None = None
    restarts: int = 0
    samples: list = field(default_factory=list)   # StepSample of each finished run
    live: StepSample | None = None                # the current run's, so far
    fit: JobFit | None = None
    # (type, size) -> step time the fit predicted when the job was first started there
    predicted: dict = field(default_factory=dict)

    def all_samples(self) -> list[StepSample]:
        return self.samples + ([self.live] if self.live else [])


def sample_of(p: Progress, gpu_type: str) -> StepSample | None:
    """The current run's mean step, once it has timed at least one step."""
    if p.timed <= 0 or p.world <= 0:
        return None
    return StepSample(gpu_type, p.world, p.timed, p.compute_s / p.timed, p.comm_s / p.timed, p.batch)


def measured_step_times(runs: Sequence[JobRun], types: Sequence[str]) -> list[dict]:
    """Per job, size and batch: measured mean step, the final fit's prediction at that
    batch, and the prediction the fit made before the job first ran at that size. A job a
    goodput-aware policy moved to another batch is compared at the batch it ran (the fit
    at the base batch against a step at twice the batch would read 50% off)."""
    out = []
    for r in runs:
        by: dict[tuple[str, int, int], list[StepSample]] = {}
        for s in r.all_samples():
            by.setdefault((s.gpu_type, s.g, s.batch or r.spec.batch), []).append(s)
        for (t, g, batch), ss in sorted(by.items()):
            n = sum(s.steps for s in ss)
            meas = sum(s.step_s * s.steps for s in ss) / n
            ratio = batch / r.spec.batch if r.spec.batch else 1.0
            out.append({"job": r.spec.name, "gpu_type": t, "gpus": g, "batch": batch, "steps": n, "measured_s": meas,
                        "fitted_s": r.fit.step_time(t, g, ratio) if r.fit else None,
                        "predicted_before_s": r.predicted.get((t, g)) if ratio == 1.0 else None})
    return out
