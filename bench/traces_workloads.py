"""Production-trace workloads of bench/sched.py (`--traces DIR`, the folder holding
`alibaba-openb-2023/` and `philly-runtimes/`): OpenB pod lists on clusters sampled from
OpenB's node list, and Poisson-arrival workloads with Philly's runtimes.

OpenB: `OPENB_JOBS` pods from pod `OPENB_SKIP` on (the first thousand are the services
already running when the trace begins, many of them months long), lifetimes capped at
`OPENB_MAX_RUN_S`, on a sample of OpenB's cluster keeping its type mix; the trace's
arrival gaps are compressed so the pods offer `LOAD` times the sample's capacity (the
whole trace offers a 6,212-GPU cluster about 15 busy GPUs: uncompressed, a sample would
sit idle and every policy would tie). Philly: runtimes drawn with Poisson arrivals at
`LOAD` on the three-type cluster of the other workloads and on the 64-GPU OpenB sample."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.job import use_goodput
from hetrain.sched.policies import get_policy
from hetrain.sched.traces_openb import openb_cluster, openb_jobs, read_openb_nodes, read_openb_pods
from hetrain.sched.traces_philly import philly_workload, read_philly_runtimes

OPENB = "alibaba-openb-2023"
PHILLY = "philly-runtimes/philly_runtime.csv"
OPENB_SKIP = 1000
OPENB_MAX_RUN_S = 48 * 3600.0
LOAD = 1.0


def _time_scale(pods, gpus: int, n: int) -> float:
    sl = pods[OPENB_SKIP:OPENB_SKIP + n]
    span = sl[-1].creation - sl[0].creation
    offered = sum(min(p.run_s, OPENB_MAX_RUN_S) * p.gpus for p in sl)
    return max(1.0, LOAD * gpus * span / offered)


def trace_workloads(root: Path, quick: bool):
    """(workload, cluster name, cluster, makers) for each trace workload."""
    root = Path(root)
    models = read_openb_nodes(root / OPENB / "openb_node_list_gpu_node.csv")
    sizes = {64: 150} if quick else {64: 200, 256: 500, 1024: 1000}
    out = []
    for variant in ("default", "gpuspec33"):
        pods = read_openb_pods(root / OPENB / f"openb_pod_list_{variant}.csv")
        for gpus, n in sizes.items():
            cluster = openb_cluster(models, gpus)
            scale = _time_scale(pods, gpus, n)
            makers = [lambda pods=pods, cluster=cluster, n=n, scale=scale: openb_jobs(
                pods, cluster, limit=n, skip=OPENB_SKIP, max_run_s=OPENB_MAX_RUN_S, time_scale=scale)]
            out.append((f"openb:{variant}", f"openb-{gpus}", cluster, makers))
    runs = read_philly_runtimes(root / PHILLY)
    seeds = [0] if quick else [0, 1, 2]
    for cname, cluster in (("three-type", parse_cluster_spec("v100:24,p100:20,k80:20")),
                           ("openb-64", openb_cluster(models, 64))):
        n = 160
        makers = [lambda s=s, cluster=cluster: philly_workload(runs, n, cluster, seed=s, load=LOAD) for s in seeds]
        out.append(("philly:poisson", cname, cluster, makers))
    return out


def openb_one_round(root: Path, policies: list[str], n_jobs: int = 2000, repeats: int = 3) -> dict:
    """One decision for `n_jobs` active OpenB jobs on the whole OpenB cluster (6,212 GPUs):
    all waiting (cold: no prices from an earlier decision), then with that decision's
    allocation running and one more job arrived (the incremental case every later
    decision is), median of `repeats`."""
    root = Path(root)
    cluster = openb_cluster(read_openb_nodes(root / OPENB / "openb_node_list_gpu_node.csv"))
    pods = read_openb_pods(root / OPENB / "openb_pod_list_gpuspec33.csv")
    out = {}
    for name in policies:
        cold, warm = [], []
        for _ in range(repeats):
            pol = get_policy(name)
            if hasattr(pol, "fresh"):
                pol = pol.fresh()  # no prices carried over from an earlier run
            jobs = openb_jobs(pods, cluster, limit=n_jobs + 1)
            use_goodput(jobs, getattr(pol, "adapts_batch", False))
            first_jobs, late = jobs[:n_jobs], jobs[n_jobs]
            t0 = time.perf_counter()
            first = pol(first_jobs, cluster, {}, 0.0)
            cold.append(time.perf_counter() - t0)
            for j in first_jobs:
                j.started = j.job_id in first
            t0 = time.perf_counter()
            pol(first_jobs + [late], cluster, first, 60.0)
            warm.append(time.perf_counter() - t0)
        out[name] = {"jobs": n_jobs, "gpus": cluster.total, "cold_s": float(np.median(cold)),
                     "next_decision_s": float(np.median(warm)), "running": len(first),
                     "gpus_given": int(sum(a.n for a in first.values()))}
        print(f"one round on OpenB: {n_jobs} jobs, {cluster.total} GPUs, {name}: {out[name]['cold_s']:.3f} s cold, "
              f"{out[name]['next_decision_s']:.3f} s next decision ({len(first)} running), median of {repeats}",
              flush=True)
    return out
