"""Alibaba's OpenB GPU cluster trace (cluster-trace-gpu-v2023, github alibaba/clusterdata;
Weng et al., "Beware of Fragmentation", USENIX ATC '23) as hetrain jobs and clusters.

Inputs, in the published CSV columns:

- node list (`openb_node_list_gpu_node.csv`): ``sn,cpu_milli,memory_mib,gpu,model``;
- pod list (`openb_pod_list_default.csv`, `..._gpuspec33.csv`):
  ``name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,
  deletion_time,scheduled_time`` (seconds).

Conversion rules (docs/scheduling.md states them too):

- **Which pods**: those asking for GPUs (num_gpu >= 1) that were placed
  (scheduled_time present) and held them a positive time; CPU-only pods and pods never
  placed (phase Pending, no scheduled_time: no run to measure) are left out.
- **GPU count**: num_gpu; a fractional request (gpu_milli < 1000, a share of one GPU) is
  rounded *up* to one whole GPU: hetrain's jobs are data-parallel rings that own their
  GPUs (GPU sharing is not modelled), and rounding down would make them vanish.
- **Work**: the pod's lifetime (deletion_time - scheduled_time) on its GPU count of its
  reference type (below). Pods that ran to completion (Succeeded) give their true
  length; Failed pods are kept with the time they held their GPUs (like killed jobs in
  Philly); pods still Running when the trace was cut keep their observed lifetime (a
  lower bound: the trace says no more). `max_run_s` optionally caps lifetimes (months-
  long latency-sensitive services are not training jobs).
- **Arrival**: creation_time, counted from the first kept pod.
- **GPU-type constraints**: gpu_spec ``A|B|C`` lists the models the pod may run on; the
  job's throughput on every other type is 0, which every policy honours (a
  configuration with no throughput is never chosen). A pod none of whose models is in
  the cluster is left out.
- **Job type and speed**: the trace does not say what a pod trains, so each job gets one
  of Gavel's measured job types by a hash of its name (as the Philly/Helios converters),
  and each OpenB model is priced as a Gavel-measured GPU times a speed factor
  (`OPENB_MODELS`; stated assumptions: V100s and P100s are themselves, a T4 is 0.7 of a
  P100 (about its FP32 rate and a third of the memory bandwidth), an A10 a V100, and the
  undisclosed G2 and G3 0.8 and 1.2 of a V100). The reference type of a job's work is
  the most plentiful model it may run on.
"""
from __future__ import annotations

import csv
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..cluster.hardware import Inventory
from ..errors import UserError
from ..perf.goodput import BatchModel
from .cluster import gpu_pools
from .gavel import load_batch_models, load_throughputs
from .job import Job, JobError, make_job

# OpenB model -> (Gavel-measured GPU it is priced as, speed factor); see the docstring
OPENB_MODELS: dict[str, tuple[str, float]] = {
    "V100M16": ("v100", 1.0), "V100M32": ("v100", 1.0), "P100": ("p100", 1.0), "T4": ("p100", 0.7),
    "A10": ("v100", 1.0), "G1": ("p100", 1.0), "G2": ("v100", 0.8), "G3": ("v100", 1.2)}
NODE_COLUMNS = ("sn", "gpu", "model")
POD_COLUMNS = ("name", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time")


class OpenBError(UserError):
    """An OpenB file that cannot be converted."""


@dataclass(frozen=True)
class OpenBPod:
    """One GPU pod of the trace, already reduced by the rules above."""

    name: str
    gpus: int
    fractional: bool
    models: tuple[str, ...]     # allowed OpenB models (empty: any)
    phase: str
    creation: float
    run_s: float


def _rows(path: Path, need: tuple[str, ...], what: str):
    try:
        fh = Path(path).open(newline="")
    except OSError as err:
        raise OpenBError(f"{path}: cannot read the OpenB {what}: {err}") from None
    with fh:
        reader = csv.DictReader(fh)
        missing = set(need) - set(reader.fieldnames or [])
        if missing:
            raise OpenBError(f"{path}: an OpenB {what} needs the columns {', '.join(need)}; missing "
                             f"{', '.join(sorted(missing))} (is this the right file?)")
        for lineno, row in enumerate(reader, start=2):
            yield f"{path}:{lineno}", row


def _num(where: str, row: dict, col: str, empty_ok: bool = False) -> float | None:
    text = (row.get(col) or "").strip()
    if not text:
        if empty_ok:
            return None
        raise OpenBError(f"{where}: column {col} is empty")
    try:
        return float(text)
    except ValueError:
        raise OpenBError(f"{where}: column {col} is {text!r}, not a number") from None


def read_openb_nodes(path: Path) -> dict[str, int]:
    """GPUs per model in a node list (nodes without GPUs are skipped)."""
    out: dict[str, int] = {}
    for where, row in _rows(path, NODE_COLUMNS, "node list"):
        gpus = int(_num(where, row, "gpu") or 0)
        model = (row.get("model") or "").strip()
        if gpus <= 0:
            continue
        if model not in OPENB_MODELS:
            raise OpenBError(f"{where}: unknown GPU model {model!r}; known: {', '.join(OPENB_MODELS)}")
        out[model] = out.get(model, 0) + gpus
    if not out:
        raise OpenBError(f"{path}: the node list has no GPU node")
    return out


def read_openb_pods(path: Path) -> list[OpenBPod]:
    """The GPU pods that ran, by the rules of the module docstring, in creation order."""
    out = []
    for where, row in _rows(path, POD_COLUMNS, "pod list"):
        num = int(_num(where, row, "num_gpu"))
        sched = _num(where, row, "scheduled_time", empty_ok=True)
        if num <= 0 or sched is None:
            continue
        milli = _num(where, row, "gpu_milli", empty_ok=True)
        run = _num(where, row, "deletion_time") - sched
        if run <= 0:
            continue
        spec = tuple(dict.fromkeys(m.strip() for m in (row.get("gpu_spec") or "").split("|") if m.strip()))
        unknown = [m for m in spec if m not in OPENB_MODELS]
        if unknown:
            raise OpenBError(f"{where}: gpu_spec names unknown model(s) {unknown}; known: {', '.join(OPENB_MODELS)}")
        out.append(OpenBPod(row["name"].strip(), num, milli is not None and milli < 1000 and num == 1, spec,
                            (row.get("pod_phase") or "").strip(), _num(where, row, "creation_time"), run))
    return sorted(out, key=lambda p: (p.creation, p.name))


def openb_cluster(models: dict[str, int], gpus: int | None = None, name: str = "openb") -> Inventory:
    """The node list's GPU pools (model names lower-cased), whole or scaled to `gpus`
    GPUs keeping the type mix (each model's share rounded by largest remainder; a model
    whose share rounds to 0 is left out)."""
    names = sorted(models, key=lambda m: (-models[m], m))
    counts = np.array([models[m] for m in names], dtype=float)
    if gpus is not None:
        if gpus < 1:
            raise OpenBError(f"a scaled OpenB cluster needs at least 1 GPU, got {gpus}")
        share = counts * gpus / counts.sum()
        base = np.floor(share)
        extra = int(gpus - base.sum())
        base[np.argsort(-(share - base), kind="stable")[:extra]] += 1
        counts = base
    keep = counts > 0
    return gpu_pools(tuple(m.lower() for m, k in zip(names, keep) if k), tuple(int(c) for c in counts[keep]),
                     name=name if gpus is None else f"{name}-{gpus}")


@dataclass
class MappedCurve:
    """A Gavel-measured curve priced on OpenB models (lower-cased names): rate on model m
    = the measured rate on its Gavel GPU x its speed factor."""

    base: object
    _alias: dict = field(default_factory=lambda: {m.lower(): v for m, v in OPENB_MODELS.items()})

    def rate(self, gpu_type: str, g: int) -> float:
        src = self._alias.get(gpu_type)
        return self.base.rate(src[0], g) * src[1] if src else self.base.rate(gpu_type, g)

    def max_gpus(self, gpu_type: str) -> int:
        src = self._alias.get(gpu_type)
        return self.base.max_gpus(src[0] if src else gpu_type)


def mapped_batch_model(bm: BatchModel) -> BatchModel:
    """The same batch model on OpenB models: a faster GPU spends less per extra sample."""
    per, local = dict(bm.per_sample_s), dict(bm.max_local)
    for m, (src, f) in OPENB_MODELS.items():
        if src in bm.per_sample_s:
            per[m.lower()] = bm.per_sample_s[src] / f
        if src in bm.max_local:
            local[m.lower()] = bm.max_local[src]
    return BatchModel(bm.base_batch, bm.max_batch, bm.noise_scale, per, local)


def openb_jobs(pods: list[OpenBPod], cluster: Inventory, limit: int | None = None, skip: int = 0,
               max_run_s: float | None = None, restart_cost: float = 10.0, elastic_max: int = 8,
               time_scale: float = 1.0, throughputs: str | None = None) -> list[Job]:
    """Jobs for the pods (after skipping `skip`, at most `limit`) on `cluster` (pools named
    by lower-cased OpenB models), by the rules of the module docstring. `time_scale` > 1
    compresses the arrivals (gaps divided by it): a scaled-down cluster sample sees the
    whole cluster's arrival rate otherwise spread over 6,212 GPUs."""
    if not time_scale > 0:
        raise OpenBError(f"time_scale must be > 0, got {time_scale}")
    curves = {k: MappedCurve(c) for k, c in load_throughputs(throughputs).items()}
    batch = {k: mapped_batch_model(b) for k, b in load_batch_models(throughputs).items()}
    kinds = sorted(curves)
    names = list(cluster.names)
    jobs: list[Job] = []
    t0 = None
    for pod in pods[skip:]:
        allowed = [m.lower() for m in pod.models if m.lower() in names] if pod.models else names
        if not allowed:
            continue
        g = min(pod.gpus, cluster.largest_pool)
        ref = max(allowed, key=lambda m: (cluster.counts[names.index(m)], m))
        fits = [k for k in kinds if curves[k].rate(ref, min(g, 8)) > 0]
        if not fits:
            continue
        kind = fits[zlib.crc32(pod.name.encode()) % len(fits)]
        run = min(pod.run_s, max_run_s) if max_run_s else pod.run_s
        t0 = pod.creation if t0 is None else t0
        try:
            job = make_job(len(jobs), kind, (pod.creation - t0) / time_scale, run * curves[kind].rate(ref, min(g, 8)), curves[kind],
                           cluster, requested=g, max_gpus=max(g, elastic_max), restart_cost=restart_cost,
                           where=f"pod {pod.name}", batch_model=batch.get(kind))
        except JobError:
            continue  # no measured throughput at its size on this cluster
        banned = np.array([t not in allowed for t in names])
        for table in (job.base_rates, job.goodput_rates):
            if table is not None:
                table[banned] = 0.0
        if not np.any(job.base_rates[:, job.min_gpus:] > 0):
            continue
        jobs.append(job)
        if limit is not None and len(jobs) >= limit:
            break
    if not jobs:
        raise OpenBError("no OpenB pod could be converted to a job on this cluster")
    return jobs
