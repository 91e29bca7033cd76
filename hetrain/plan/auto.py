"""Planning from a few profiled steps of the job itself (`hetrain launch --auto`).

A profiling round trains a few steps on the cluster as launched; its `steps.jsonl` gives
every worker's compute time against its share per step, which the step-time model
(`perf.steptime.StepTimeModel`) turns into each worker's `fixed + per_sample · b` line;
its `summary.json` gives the measured step time and what the model weighs (gradient
bytes, activation bytes per sample, measured in the run). The framework's overhead per
step is then fitted (`perf.job.fit`) so the model reproduces the profiled step, and
every candidate is predicted and ranked on the fitted model.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..cluster.spec import ClusterSpec
from ..errors import UserError
from ..modes import Codec, Mode
from ..perf.job import COMM_MODES, Candidate, Fitted, JobCluster, JobModel, JobWorker, fit, predict
from ..perf.stepfit import StepTimeModel
from .job import DEFAULT_FITTED, job_cluster

SKIP = 2  # first profiled steps left out of the fits (start-up, shares still equal)


def _read(run_dir: Path) -> tuple[list[dict], dict]:
    steps_path, summary_path = run_dir / "steps.jsonl", run_dir / "summary.json"
    for path in (steps_path, summary_path):
        if not path.is_file():
            raise UserError(f"{path} does not exist: the profiling round did not finish; see its log in {run_dir}")
    rows = [json.loads(line) for line in steps_path.read_text().splitlines() if line.strip()]
    return rows, json.loads(summary_path.read_text())


def worker_lines(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """(fixed s, s per sample) of every worker, fitted on its profiled steps."""
    labels = list(rows[0]["ranks"])
    out = {}
    for lab in labels:
        m = StepTimeModel(window=max(2, len(rows)), recent=max(1, min(5, len(rows))))
        for r in rows[SKIP:] if len(rows) > SKIP + 1 else rows:
            m.add(int(r["ranks"][lab]["samples"]), float(r["ranks"][lab]["compute_s"]))
        fixed, per = m.fit()
        if not np.isfinite(per):
            raise UserError(f"worker {lab} computed no samples while profiling; profile more steps (--auto-steps)")
        out[lab] = (fixed, per)
    return out


def fitted_from_run(run_dir: str | Path, cluster: ClusterSpec,
                    base: Fitted = DEFAULT_FITTED) -> tuple[JobModel, JobCluster, Fitted, int]:
    """The cost model fitted on a profiling round run in fp32 without overlap (its mode and
    share policy are read from its summary): (model, cluster, fitted constants, global batch)."""
    rows, summary = _read(Path(run_dir))
    try:  # the summary's words, parsed here once; co-located servers are priced as BytePS
        mode = Mode.parse(summary.get("mode", "")).priced
    except UserError:
        mode = None
    if mode not in COMM_MODES:
        raise UserError(f"{run_dir}/summary.json: mode {summary.get('mode')!r} cannot be profiled for planning")
    # all-reduce always overlaps (buckets from backward's hooks); the server modes ran without
    profiled = Candidate(mode, "equal" if summary.get("balance") == "equal" else "balanced", not mode.has_servers,
                         Codec.FP32)
    facts = summary.get("model")
    if not facts:
        raise UserError(f"{run_dir}/summary.json has no `model` facts: the script does not record them "
                        "(hetrain.train.summary.model_facts); --auto needs a script that does (the demo, "
                        "hetrain.demo.zoo)")
    model = JobModel(summary.get("model_name", "script"), facts["grad_bytes"], facts["act_bytes_per_sample"])
    lines = worker_lines(rows)
    shape = job_cluster(cluster, cost_per_sample=1.0)
    if [w.name for w in shape.workers] != list(lines):
        raise UserError(f"the profiling round's workers {list(lines)} are not the cluster's "
                        f"{[w.name for w in shape.workers]}")
    workers = tuple(JobWorker(w.name, lines[w.name][1], w.bandwidth, lines[w.name][0], w.memory, w.price_per_hour)
                    for w in shape.workers)
    # the cluster's links and pacing kept; the overlap window of a real backward (the profiled
    # lines are the script's own compute, whatever device model it runs)
    jc = replace(shape, workers=workers, overlap_window=JobCluster.overlap_window)
    batch = int(summary["global_batch"])
    measured = float(np.median([r["step_s"] for r in summary["ranks"].values()]))
    # every worker trained in the round (the balancer leaves none out before it measured them)
    fitted = fit([(predict(profiled, model, jc, batch, base, every_worker=True), measured)], base)
    return model, jc, fitted, batch
