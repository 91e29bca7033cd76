"""Whole-job planning: every way to train a model data-parallel on a cluster file, predicted
by the one cost model (`hetrain.perf.job`), ranked, and written as a plan that `hetrain
launch --plan` runs.

The model comes from the one profiler (`plan.profile`: a zoo model profiled now, or a
saved profile), or is the demo's digits classifier; the cluster from a cluster file
(`cluster.spec`): each worker's seconds per sample are the profile's per-layer times
scaled by its kind's speed per layer kind (`kinds:`) and its emulated `speed`, its
memory and price come from its device and kind, the CPU-only machines are the summation
servers BytePS and PS can use. Where the cluster's devices run the calibrated device
model (`--cost-per-sample`: a step of b samples takes b·cost/speed, as the demo and the
benchmarks run on emulated clusters) that cost replaces the profile's compute time.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from ..cluster.spec import ClusterSpec, parse_cluster
from ..errors import UserError
from ..fileio import Strict, read_structured, validate_file
from ..modes import Codec
from ..perf.comm import memcpy_speed
from ..perf.job import (CODEC_RATIO, Candidate, Fitted, JobCluster, JobModel, JobWorker, Prediction, candidates,
                        predict, rank)

DEMO = "digits"  # the demo's model (hetrain.demo.digits): not a layer chain, described by its parameters
# encode + decode seconds per fp32 byte of each codec, one core of the development host
# (comm.compress on a 1M-element gradient: fp16 0.20 ns, int8 3.2 ns, int4 6.1 ns per byte)
CODEC_COST = {Codec.FP32: 0.0, Codec.FP16: 0.2e-9, Codec.INT8: 3.2e-9, Codec.INT4: 6.1e-9}
DEFAULT_FITTED = Fitted(codec_s_per_byte=CODEC_COST)


class PlanFileError(UserError):
    """A whole-job plan file that cannot be used."""


def demo_model() -> JobModel:
    """The digits classifier of `hetrain demo` (64-128-64-10 MLP, SGD with momentum)."""
    params = 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    acts = 4.0 * (64 + 128 + 128 + 64 + 64 + 10)  # every layer's output, fp32, per sample
    return JobModel(DEMO, grad_bytes=4.0 * params, act_bytes_per_sample=acts)


def model_from_profile(profile) -> JobModel:
    """Gradient bytes (dense parameters; sparse tables are pushed as dense gradients by the
    data-parallel runtime) and stored activation bytes of a `ModelProfile`."""
    grad = float(sum(l.dense_param_bytes + l.sparse_param_bytes for l in profile.layers))
    acts = float(sum(l.stored_act_bytes for l in profile.layers))
    layers = tuple(float(l.dense_param_bytes + l.sparse_param_bytes) for l in profile.layers)
    return JobModel(profile.model, grad_bytes=grad, act_bytes_per_sample=acts, layer_grad_bytes=layers)


def per_sample_on(profile, kind) -> float:
    """Seconds per sample of the whole model on a device kind: each layer's host time over
    the kind's speed for that layer kind (1 where the kind's speed is not described)."""
    return float(sum(l.time_s / (kind.speed.for_kind(l.kind) if kind.speed else 1.0) for l in profile.layers))


def job_cluster(cluster: ClusterSpec, profile=None, cost_per_sample: float | None = None,
                fixed_s: float = 0.0) -> JobCluster:
    """The cost model's view of a cluster file: one `JobWorker` per worker process."""
    if profile is None and cost_per_sample is None:
        raise UserError("a model profile or a cost per sample is needed to predict compute times")
    workers = []
    for m in cluster.workers:
        kind = cluster.kind_of(m)
        base = cost_per_sample if cost_per_sample is not None else per_sample_on(profile, kind)
        memory = m.device.memory if m.device.memory is not None else (kind.memory or np.inf)
        for g in range(m.local_workers):
            name = m.name if m.local_workers == 1 else f"{m.name}.{g}"
            workers.append(JobWorker(name, base / m.device.speed, m.bandwidth, fixed_s, float(memory),
                                     kind.price_per_hour or 0.0))
    cpu = cluster.cpu_machines
    cpu_price = tuple(cluster.kind("cpu").price_per_hour or 0.0 for _ in cpu)
    # the in-process rate limiter paces uploads only; tc (netns) and real NICs limit both directions
    duplex = cluster.network.emulate != "ratelimit"
    # the calibrated device model slows a step down after its real backward: an overlapped
    # exchange can run during all of it (on a real device, during backward: about 2/3)
    window = 1.0 if cost_per_sample is not None else 2 / 3
    # every worker on one node (Linux), links not emulated: the runtime's all-reduce among
    # them goes through shared memory (comm/shm/select.py), at this host's memcpy speed
    shared = (cluster.network.emulate == "none" and len({m.node for m in cluster.workers}) == 1
              and len(workers) > 1 and hasattr(os, "sched_getaffinity"))
    host = dict(shared_memory=True, memcpy_speed=_memcpy_speed(), cores=len(os.sched_getaffinity(0))) if shared else {}
    return JobCluster(tuple(workers), tuple(m.bandwidth for m in cpu), cpu_price, duplex=duplex,
                      overlap_window=window, paced_before_send=not duplex, **host)


@functools.lru_cache(maxsize=1)
def _memcpy_speed() -> float:
    """This host's memcpy speed, measured once per process (`perf.comm.memcpy_speed`)."""
    return memcpy_speed()


def plan_job(model: JobModel, cluster: JobCluster, global_batch: int, target: float | None = None,
             budget: float | None = None, fitted: Fitted = DEFAULT_FITTED, codecs=tuple(CODEC_RATIO)):
    """Every candidate predicted and ranked, best first."""
    if global_batch < 1:
        raise UserError(f"the global batch must be >= 1 sample, got {global_batch}")
    preds = [predict(c, model, cluster, global_batch, fitted) for c in candidates(cluster, codecs=codecs)]
    return rank(preds, target, budget)


def heterps_row(profile, cluster_path: str, global_batch: int) -> str:
    """The HeterPS alternative on the same machines: the highest throughput a layer placement
    (pipeline stages over the cluster's kinds, perf/pipeline.py) reaches and what it costs, or
    why it cannot be weighed (kinds not described for planning, the demo's model)."""
    from ..perf.pipeline import CostParams
    from .base import Problem
    from .planners import get_planner
    from .catalogue import CatalogueError, load_catalogue
    from .exact import max_throughput

    if profile is None:
        return "HeterPS layer placement: not weighed (the demo's model is not a layer chain)"
    try:
        catalogue = load_catalogue(cluster_path)
    except CatalogueError as err:
        return f"HeterPS layer placement: not weighed ({str(err).split(': ', 1)[-1]})"
    problem = Problem(profile.workload(catalogue), 1.0, CostParams(batch_size=global_batch))
    best, _ = max_throughput(problem)
    if best <= 0:
        return "HeterPS layer placement: no placement fits the cluster's kinds"
    result = get_planner("exact").plan(problem.with_target(best * 0.999))
    names = catalogue.names
    stages = " | ".join(f"layers {st.start}-{st.end - 1} on {names[st.rtype]} x{st.instances}"
                        for st in result.score.stages)
    per_m = result.score.hourly / (best * 3600) * 1e6 if result.feasible else float("nan")
    return (f"HeterPS layer placement on the same kinds: up to {best:,.1f} samples/s ({stages}), ${per_m:.3f}/1M "
            f"samples; run it with `hetrain plan --catalogue {cluster_path}` and `hetrain train --plan`")


def table(preds: list[Prediction], top: int = 12) -> str:
    head = f"{'#':>3} {'candidate':<34}{'samples/s':>11}{'step ms':>9}{'memory':>8}{'$/1M':>9}  why"
    lines = [head, "-" * 100]
    for i, p in enumerate(preds[:top], 1):
        mem = "fits" if p.fits else "NO"
        cost = f"{p.dollars_per_million:9.3f}" if p.dollars_per_hour > 0 else f"{'-':>9}"
        lines.append(f"{i:>3} {p.candidate.label():<34}{p.samples_per_s:>11.1f}{p.step_s * 1e3:>9.2f}{mem:>8}"
                     f"{cost}  {p.why}")
    if len(preds) > top:
        lines.append(f"    ... {len(preds) - top} more candidates (all in the plan file)")
    return "\n".join(lines)


# ---- the plan file ---------------------------------------------------------------------

class JobConfig(Strict):
    """What `hetrain launch --plan` sets: the launch's communication and the script's shares."""

    mode: Literal["allreduce", "byteps", "ps"]
    codec: Literal["fp32", "fp16", "int8", "int4"]
    overlap: bool
    balance: Literal["measured", "equal"]
    global_batch: int = Field(ge=1)


class JobPrediction(Strict):
    step_s: float = Field(gt=0)
    samples_per_s: float = Field(gt=0)
    memory: dict[str, float]
    shares: dict[str, int]
    dollars_per_hour: float = Field(ge=0)
    fits: bool
    why: str = ""


class JobPlan(Strict):
    """A whole-job plan file (`hetrain plan --cluster`): the chosen configuration, its
    prediction, the cluster it was planned for and the script that trains the model."""

    kind: Literal["whole-job"] = "whole-job"
    model: str
    cluster: dict
    config: JobConfig
    predicted: JobPrediction
    script: list[str] = Field(min_length=1)
    ranking: list[dict] = Field(default_factory=list)

    def cluster_spec(self) -> ClusterSpec:
        return parse_cluster(self.cluster, "plan file's cluster")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=1))


def is_job_plan(data: object) -> bool:
    return isinstance(data, dict) and data.get("kind") == "whole-job"


def load_job_plan(path: str | Path) -> JobPlan:
    data = read_structured(path, "plan file", PlanFileError)
    if not is_job_plan(data):
        raise PlanFileError(f"{path} is not a whole-job plan (written by `hetrain plan --cluster ... --model ...`); "
                            "a HeterPS placement plan runs with `hetrain train --plan`")
    return validate_file(JobPlan, data, what="plan file", source=str(path), docs="docs/user-guide.md",
                         error=PlanFileError, expected="a JSON object written by `hetrain plan --cluster`")


def script_for(model: str, cfg: JobConfig, cost_per_sample: float | None, epochs: int) -> list[str]:
    """The training script that runs `model` under a plan (the demo, or the zoo trainer)."""
    args = ["--global-batch", str(cfg.global_batch), "--balance", cfg.balance, "--epochs", str(epochs)]
    if cost_per_sample is not None:
        args += ["--cost-per-sample", repr(float(cost_per_sample))]
    if model == DEMO:
        return ["-m", "hetrain.demo.digits", *args]
    return ["-m", "hetrain.demo.zoo", "--model", model, *args]


def to_plan(best: Prediction, preds: list[Prediction], model: str, cluster: ClusterSpec, jc: JobCluster,
            cost_per_sample: float | None, epochs: int = 2) -> JobPlan:
    c = best.candidate
    cfg = JobConfig(mode=c.mode, codec=c.codec, overlap=c.overlap,
                    balance="measured" if c.shares == "balanced" else "equal", global_batch=best.global_batch)
    names = [w.name for w in jc.workers]
    pred = JobPrediction(step_s=best.step_s, samples_per_s=best.samples_per_s,
                         memory=dict(zip(names, map(float, best.memory))),
                         shares=dict(zip(names, map(int, best.shares))),
                         dollars_per_hour=best.dollars_per_hour, fits=best.fits, why=best.why)
    ranking = [{"candidate": p.candidate.label(), "predicted_s": p.step_s, "samples_per_s": p.samples_per_s,
                "fits": p.fits, "dollars_per_million": p.dollars_per_million if p.dollars_per_hour else None,
                "why": p.why} for p in preds]
    return JobPlan(model=model, cluster=cluster.to_file(), config=cfg, predicted=pred,
                   script=script_for(model, cfg, cost_per_sample, epochs), ranking=ranking)


def candidate_of(cfg: JobConfig) -> Candidate:
    return Candidate(cfg.mode, "balanced" if cfg.balance == "measured" else "equal", cfg.overlap, cfg.codec)
