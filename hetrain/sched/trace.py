"""Gavel/Philly job traces: one job a line, tab-separated

    job type \t command \t step flag \t needs data dir \t total steps \t arrival s \t GPUs asked

(the command, flag and data-dir fields are ignored). Every mistake is reported as
``FILE:LINE: what is wrong`` so the line can be fixed."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..cluster.hardware import Inventory
from .gavel import bundled_traces, load_batch_models, load_throughputs, trace_path
from .job import Job, JobError, make_job


class TraceError(UserError):
    """A trace line that cannot be read."""


def parse_trace_lines(lines, cluster: Inventory, source: str = "<trace>", restart_cost: float = 10.0,
                      throughputs: str | None = None, limit: int | None = None, elastic_max: int = 8) -> list[Job]:
    curves = load_throughputs(throughputs)
    batch_models = load_batch_models(throughputs)
    jobs: list[Job] = []
    for lineno, raw in enumerate(lines, start=1):
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{source}:{lineno}: the line is not UTF-8 text") from None
        line = raw.rstrip("\n").rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source}:{lineno}"
        fields = line.split("\t")
        if len(fields) != 7:
            raise TraceError(f"{where}: expected 7 tab-separated fields (job type, command, step flag, "
                             f"data-dir flag, total steps, arrival s, GPUs), found {len(fields)}")
        job_type, steps_s, arrival_s, gpus_s = fields[0].strip(), fields[4].strip(), fields[5].strip(), fields[6].strip()
        if job_type not in curves:
            known = ", ".join(sorted(curves)[:4])
            raise TraceError(f"{where}: unknown job type {job_type!r}; it must be a key of "
                             f"simulation_throughputs.json (e.g. {known}, ...)")
        try:
            steps = int(steps_s)
        except ValueError:
            raise TraceError(f"{where}: total steps {steps_s!r} is not an integer") from None
        if steps <= 0:
            raise TraceError(f"{where}: total steps must be > 0, got {steps}")
        try:
            arrival = float(arrival_s)
        except ValueError:
            raise TraceError(f"{where}: arrival time {arrival_s!r} is not a number of seconds") from None
        if not arrival >= 0 or arrival == float("inf"):
            raise TraceError(f"{where}: arrival time must be a finite number >= 0, got {arrival_s}")
        try:
            gpus = int(gpus_s)
        except ValueError:
            raise TraceError(f"{where}: GPU count {gpus_s!r} is not an integer") from None
        if gpus < 1:
            raise TraceError(f"{where}: GPU count must be >= 1, got {gpus}")
        try:
            job = make_job(len(jobs), job_type, arrival, steps, curves[job_type], cluster, requested=gpus,
                           min_gpus=1, max_gpus=max(gpus, elastic_max), restart_cost=restart_cost, where=where,
                           batch_model=batch_models.get(job_type))
        except JobError as err:
            raise TraceError(str(err)) from None
        jobs.append(job)
        if limit is not None and len(jobs) >= limit:
            break
    if not jobs:
        raise TraceError(f"{source}: the trace has no jobs")
    return jobs


def load_trace(path: str | Path, cluster: Inventory, **kw) -> list[Job]:
    path = trace_path(path)
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist (shipped traces, usable by name: "
                         f"{', '.join(bundled_traces())})")
    with path.open("rb") as fh:  # bytes: a line that is not UTF-8 is reported by number
        return parse_trace_lines(fh, cluster, source=str(path), **kw)
