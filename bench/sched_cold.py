"""One cold decision of the goodput policy on the whole OpenB cluster (6,212 GPUs of 7
types, 2,000 active jobs, no earlier decision), with the columns of its integer program
built the earlier way (a Python loop over every job and GPU type, the baseline, kept
here) and the current way (`policies.goodput.candidates`: one numpy pass over all
jobs), alternated in one run; then where the cold decision's time goes (cProfile).

    python bench/sched_cold.py --traces DIR --json out.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetrain.sched.job import use_goodput  # noqa: E402
from hetrain.sched.policies import goodput  # noqa: E402
from hetrain.sched.traces_openb import openb_cluster, openb_jobs, read_openb_nodes, read_openb_pods  # noqa: E402

OPENB = "alibaba-openb-2023"


def candidates_per_job(jobs, cluster, allocation):
    """The baseline: the columns built job by job and type by type, as before."""
    out = []
    for i, job in enumerate(jobs):
        cur = allocation.get(job.job_id)
        for t, cap in enumerate(cluster.counts):
            top = min(job.max_gpus, int(cap))
            fine = goodput.NODE_GPUS if cap <= goodput.FINE_POOL else 1
            counts = list(range(job.min_gpus, min(top, fine) + 1))
            k = 2 * fine
            while k <= top:
                if k >= job.min_gpus:
                    counts.append(k)
                k *= 2
            if cur is not None and cur.type == t and cur.n <= top and cur.n not in counts:
                counts.append(cur.n)
            out += [(i, t, n, job.rates[t, n]) for n in sorted(counts) if job.rates[t, n] > 0]
    jidx, ts, ns, rate = (np.array(x) for x in zip(*out))
    return jidx.astype(np.int64), ts.astype(np.int64), ns.astype(np.int64), rate.astype(float)


def cold_decision(cluster, pods, n_jobs: int, prof: cProfile.Profile | None = None):
    """A fresh policy and fresh jobs (nothing cached), timed (and profiled) on one decision."""
    pol = goodput.goodput_policy()
    jobs = openb_jobs(pods, cluster, limit=n_jobs)
    use_goodput(jobs, True)
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    plan = pol(jobs, cluster, {}, 0.0)
    dt = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    return dt, plan


def profile(cluster, pods, n_jobs: int, top: int = 14) -> str:
    pr = cProfile.Profile()
    cold_decision(cluster, pods, n_jobs, pr)
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, required=True, help="folder holding alibaba-openb-2023/")
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    root = args.traces / OPENB
    cluster = openb_cluster(read_openb_nodes(root / "openb_node_list_gpu_node.csv"))
    pods = read_openb_pods(root / "openb_pod_list_gpuspec33.csv")
    current = goodput.candidates
    ways = {"per-job loop (before)": candidates_per_job, "numpy (now)": current}
    cold_decision(cluster, pods, args.jobs)  # warm-up: imports, HiGHS
    times = {k: [] for k in ways}
    plans = {}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            goodput.candidates = fn
            dt, plan = cold_decision(cluster, pods, args.jobs)
            times[name].append(dt)
            plans[name] = plan
    goodput.candidates = current
    same = plans["per-job loop (before)"] == plans["numpy (now)"]
    print(f"one cold decision: {args.jobs} OpenB jobs on {cluster.total} GPUs ({len(cluster.names)} types), "
          f"median of {args.repeats}, alternated")
    print(f"{'columns built by':<26}{'median s':>10}{'min s':>9}{'max s':>9}")
    for name, v in times.items():
        print(f"{name:<26}{np.median(v):>10.3f}{min(v):>9.3f}{max(v):>9.3f}")
    ratio = float(np.median(times["numpy (now)"]) / np.median(times["per-job loop (before)"]))
    print(f"now / before: {ratio:.3f}; the same plan: {same}")
    prof = {}
    for name, fn in ways.items():
        goodput.candidates = fn
        prof[name] = profile(cluster, pods, args.jobs)
        print(f"\ncProfile, {name}:\n{prof[name]}")
    goodput.candidates = current
    if args.json:
        Path(args.json).write_text(json.dumps({
            "jobs": args.jobs, "gpus": cluster.total, "repeats": args.repeats,
            "cold_s": {k: v for k, v in times.items()}, "median_s": {k: float(np.median(v)) for k, v in times.items()},
            "now_over_before": ratio, "same_plan": same, "cprofile": prof}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
