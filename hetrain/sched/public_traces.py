"""Public production traces converted to hetrain's trace format (one job a line,
tab-separated: job type, command, step flag, data-dir flag, total steps, arrival s, GPUs).

- **Philly** (Microsoft, ATC'19; github msr-fiddle/philly-traces): `cluster_job_log`,
  a JSON list of jobs ``{"jobid", "status", "vc", "user", "submitted_time",
  "attempts": [{"start_time", "end_time", "detail": [{"ip", "gpus": [...]}]}]}`` with
  times as ``YYYY-MM-DD HH:MM:SS`` (``None`` where unknown).
- **Helios** (SenseTime, SC'21; github S-Lab-System-Group/HeliosData): a cluster's
  `cluster_log.csv` with columns ``job_id, user, vc, gpu_num, cpu_num, node_num, state,
  submit_time, start_time, end_time, duration, queue`` (duration in seconds).

Neither trace says what a job trains, so each job is given a measured job type (a key
of the throughputs table) picked by a hash of its id among the types that run at its
GPU count on the trace's GPU (deterministic, about uniform), and its work is the steps
that type makes in the job's recorded run time on that many GPUs of that GPU:
Philly's GPUs are taken as P100s (its 12 GB GPUs; the 24 GB P40s are not in the
table), Helios's as V100s. Jobs asking for more GPUs than the table measures (8) keep
their run time at 8 GPUs. Jobs without GPUs, or that never ran (no start or end
time), are left out; killed and failed jobs are kept (they held GPUs that long).
Arrival times count from the first kept job's submission.

    python -m hetrain.sched.public_traces philly cluster_job_log out.trace [--jobs N]
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import zlib
from datetime import datetime
from pathlib import Path
from typing import Iterable, Literal, NamedTuple

from ..errors import UserError
from .gavel import load_throughputs

TraceKind = Literal["philly", "helios"]
TRACE_GPU: dict[str, str] = {"philly": "p100", "helios": "v100"}
_TIME = "%Y-%m-%d %H:%M:%S"


class TraceError(UserError):
    """A public trace that cannot be converted."""


class PublicJob(NamedTuple):
    job_id: str
    submit: datetime
    gpus: int
    run_s: float


def _time(text) -> datetime | None:
    if text is None or str(text).strip() in ("", "None", "null"):
        return None
    try:
        return datetime.strptime(str(text).strip(), _TIME)
    except ValueError:
        return None


def read_philly(path: Path) -> list[PublicJob]:
    """Jobs of Philly's cluster_job_log: GPUs of the first attempt, run time summed over attempts."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: not a readable Philly cluster_job_log (a JSON list of jobs): {err}") from None
    if not isinstance(data, list):
        raise TraceError(f"{path}: a Philly cluster_job_log is a JSON list of jobs, found {type(data).__name__}")
    out = []
    for k, job in enumerate(data):
        if not isinstance(job, dict) or "attempts" not in job:
            raise TraceError(f"{path}: job #{k} has no 'attempts' (is this Philly's cluster_job_log?)")
        submit = _time(job.get("submitted_time"))
        attempts = job.get("attempts") or []
        run = 0.0
        for a in attempts:
            s, e = _time(a.get("start_time")), _time(a.get("end_time"))
            if s and e and e > s:
                run += (e - s).total_seconds()
        gpus = sum(len(d.get("gpus") or []) for d in (attempts[0].get("detail") or [])) if attempts else 0
        if submit and gpus > 0 and run > 0:
            out.append(PublicJob(str(job.get("jobid", k)), submit, gpus, run))
    return out


def read_helios(path: Path) -> list[PublicJob]:
    """Jobs of a Helios cluster_log.csv that used GPUs and ran."""
    need = {"job_id", "gpu_num", "submit_time", "duration"}
    try:
        with Path(path).open(newline="") as fh:
            reader = csv.DictReader(fh)
            missing = need - set(reader.fieldnames or [])
            if missing:
                raise TraceError(f"{path}: a Helios cluster_log.csv needs the columns {sorted(need)}; "
                                 f"missing {sorted(missing)}")
            out = []
            for row in reader:
                submit = _time(row["submit_time"])
                try:
                    gpus, run = int(row["gpu_num"]), float(row["duration"])
                except (TypeError, ValueError):
                    continue
                if submit and gpus > 0 and run > 0:
                    out.append(PublicJob(row["job_id"], submit, gpus, run))
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: not a readable Helios cluster_log.csv: {err}") from None
    return out


def to_trace_lines(jobs: Iterable[PublicJob], kind: TraceKind, limit: int | None = None,
                   throughputs: str | None = None) -> list[str]:
    """hetrain trace lines for the jobs, in submission order (the first `limit`)."""
    curves = load_throughputs(throughputs)
    gpu = TRACE_GPU[kind]
    jobs = sorted(jobs, key=lambda j: (j.submit, j.job_id))[:limit]
    if not jobs:
        raise TraceError(f"the {kind} trace has no job that used GPUs and ran")
    t0 = jobs[0].submit
    lines = []
    for j in jobs:
        g = min(j.gpus, 8)
        kinds = sorted(k for k, c in curves.items() if c.rate(gpu, g) > 0)
        if not kinds:
            raise TraceError(f"no measured job type runs on {g} {gpu} GPUs")
        job_type = kinds[zlib.crc32(j.job_id.encode()) % len(kinds)]
        steps = max(1, round(j.run_s * curves[job_type].rate(gpu, g)))
        arrival = (j.submit - t0).total_seconds()
        lines.append(f"{job_type}\t{kind}:{j.job_id}\t-n\t0\t{steps}\t{arrival:.1f}\t{g}\n")
    return lines


def convert_public(kind: TraceKind, path: Path, limit: int | None = None, throughputs: str | None = None) -> list[str]:
    """Read a public trace of `kind` and return hetrain trace lines."""
    readers = {"philly": read_philly, "helios": read_helios}
    if kind not in readers:
        raise TraceError(f"unknown public trace kind {kind!r}; use philly or helios")
    return to_trace_lines(readers[kind](Path(path)), kind, limit, throughputs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="convert a Philly or Helios trace to hetrain's trace format")
    ap.add_argument("kind", choices=["philly", "helios"])
    ap.add_argument("source", type=Path, help="Philly cluster_job_log (JSON) or Helios cluster_log.csv")
    ap.add_argument("out", type=Path, help="the hetrain trace to write")
    ap.add_argument("--jobs", type=int, help="keep the first N jobs (submission order)")
    args = ap.parse_args(argv)
    try:
        lines = convert_public(args.kind, args.source, args.jobs)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.write_text("".join(lines))
    print(f"wrote {len(lines)} jobs to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
