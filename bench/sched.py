"""Benchmark of the cluster job scheduler: average JCT of every policy on
synthetic patterns and Gavel traces, on a homogeneous and a three-type cluster;
doubling versus fifo and versus the exact optimum; simulate-vs-real for the
executor's tiny workload (when the executor is available); and the scale test
(1,000+ trace jobs on 900 GPUs).

    python bench/sched.py --quick --json out.json
Simulations are deterministic, so each case runs once per seed; the table shows the
mean over seeds (3 seeds, 1 with --quick)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetrain.sched.cluster import parse_cluster_spec  # noqa: E402
from hetrain.sched.gavel import default_data_dir  # noqa: E402
from hetrain.sched.patterns import make_pattern  # noqa: E402
from hetrain.sched.simulator import simulate  # noqa: E402
from hetrain.sched.trace import load_trace  # noqa: E402

CLUSTERS = {"homogeneous": "v100:24", "three-type": "v100:8,p100:8,k80:8"}
SMALL_CLUSTERS = {"homogeneous": "v100:8", "three-type": "v100:4,p100:4,k80:4"}
PATTERNS = ["all-at-once", "poisson", "bursts", "poisson-short", "all-at-once-long"]
TRACES = ["23dbec", "51b7ef", "0e4a51"]
POLICIES = ["fifo", "srtf", "doubling", "doubling-strict"]


def run_case(make, cluster, policy):
    return simulate(make(), cluster, policy)


def bench(quick: bool, out_json: str | None, png_dir: str | None) -> dict:
    seeds = [0] if quick else [0, 1, 2]
    n_jobs = 40 if quick else 100
    n_small = 10
    cases = []

    def add(workload, cname, cluster, policies, makers):
        for pol in policies:
            res = [run_case(m, cluster, pol) for m in makers]
            case = {"workload": workload, "cluster": cname, "cluster_spec": cluster.spec, "policy": pol,
                    "jobs": int(len(res[0].jct)), "seeds": len(makers),
                    "avg_jct_s": float(np.mean([r.avg_jct_s for r in res])),
                    "p99_jct_s": float(np.mean([r.p99_jct_s for r in res])),
                    "makespan_s": float(np.mean([r.makespan_s for r in res])),
                    "utilization": float(np.mean([r.utilization for r in res])),
                    "restarts": float(np.mean([r.restarts for r in res]))}
            cases.append(case)
            print(f"{workload:<22}{cname:<12}{pol:<16}{case['avg_jct_s'] / 3600:>9.3f}{case['p99_jct_s'] / 3600:>9.2f}"
                  f"{case['makespan_s'] / 3600:>9.2f}{case['utilization']:>6.2f}{case['restarts']:>8.1f}", flush=True)

    print(f"{'workload':<22}{'cluster':<12}{'policy':<16}{'avg JCT h':>9}{'p99 h':>9}{'mkspan h':>9}{'util':>6}{'restarts':>8}")
    for cname, spec in CLUSTERS.items():
        cluster = parse_cluster_spec(spec)
        for pat in PATTERNS:
            makers = [lambda s=s, pat=pat: make_pattern(pat, n_jobs, cluster, seed=s) for s in seeds]
            add(pat, cname, cluster, POLICIES + (["optimal"] if quick else []), makers)
        for tr in TRACES:
            path = default_data_dir() / "traces" / f"{tr}.trace"
            makers = [lambda path=path: load_trace(path, cluster, limit=n_jobs)]
            add(f"trace:{tr}", cname, cluster, POLICIES, makers)
    # small instances: the exact optimum is the yardstick
    for cname, spec in SMALL_CLUSTERS.items():
        cluster = parse_cluster_spec(spec)
        for pat in ["all-at-once", "poisson", "bursts"]:
            makers = [lambda s=s, pat=pat: make_pattern(pat, n_small, cluster, seed=s) for s in seeds]
            add(f"small:{pat}", cname, cluster, ["fifo", "doubling", "optimal"], makers)

    def avg(w, c, p):
        for x in cases:
            if x["workload"] == w and x["cluster"] == c and x["policy"] == p:
                return x["avg_jct_s"]
        return None

    ratios = []
    for x in cases:
        if x["policy"] != "doubling":
            continue
        f, o = avg(x["workload"], x["cluster"], "fifo"), avg(x["workload"], x["cluster"], "optimal")
        ratios.append({"workload": x["workload"], "cluster": x["cluster"],
                       "doubling_over_fifo": x["avg_jct_s"] / f if f else None,
                       "doubling_over_optimal": x["avg_jct_s"] / o if o else None})
    print(f"\n{'workload':<22}{'cluster':<12}{'doubling/fifo':>14}{'doubling/optimal':>18}")
    for r in ratios:
        o = f"{r['doubling_over_optimal']:.3f}" if r["doubling_over_optimal"] else "-"
        print(f"{r['workload']:<22}{r['cluster']:<12}{r['doubling_over_fifo']:>14.3f}{o:>18}")

    # scale: 1,000+ trace jobs on 900 GPUs (Gavel's 300:300:300 cluster)
    big = parse_cluster_spec("300:300:300")
    n_big = 1000 if quick else 2000
    jobs = load_trace(default_data_dir() / "traces" / "6214e9.trace", big, limit=n_big)
    t0 = time.perf_counter()
    res = simulate(jobs, big, "doubling", progress=sys.stderr.isatty())
    wall = time.perf_counter() - t0
    scale = {"jobs": len(jobs), "gpus": big.total, "policy": "doubling", "wall_s": wall,
             "decisions": res.decisions, "ms_per_decision": 1e3 * res.decision_wall_s / max(1, res.decisions),
             "avg_jct_s": res.avg_jct_s}
    print(f"\nscale: {len(jobs)} jobs on {big.total} GPUs, doubling: {wall:.2f} s wall, {res.decisions} decisions, "
          f"{scale['ms_per_decision']:.2f} ms/decision")

    sim_vs_real = None
    try:
        from hetrain.sched.executor import bench_sim_vs_real
    except ImportError:
        print("sim vs real: executor not available in this checkout")
    else:
        sim_vs_real = bench_sim_vs_real()
        print(f"sim vs real (executor workload): sim {sim_vs_real['sim_s']:.2f} s, real {sim_vs_real['real_s']:.2f} s, "
              f"ratio {sim_vs_real['sim_s'] / sim_vs_real['real_s']:.3f}")

    dvf = [r["doubling_over_fifo"] for r in ratios if not r["workload"].startswith("small:")]
    dvo = [r["doubling_over_optimal"] for r in ratios if r["doubling_over_optimal"]]
    checks = {"best_doubling_over_fifo": min(dvf), "worst_doubling_over_fifo": max(dvf),
              "worst_doubling_over_optimal": max(dvo) if dvo else None,
              "scale_under_60s": wall < 60}
    print("\nchecks:", json.dumps(checks))
    out = {"cases": cases, "ratios": ratios, "sim_vs_real": sim_vs_real, "scale": scale, "checks": checks}
    if out_json:
        Path(out_json).write_text(json.dumps(out, indent=1))
        print(f"wrote {out_json}")
    if png_dir:
        from hetrain.sched.plots import plot_jct_cdf, plot_timeline
        d = Path(png_dir)
        d.mkdir(parents=True, exist_ok=True)
        cl = parse_cluster_spec(CLUSTERS["three-type"])
        rs = [simulate(make_pattern("poisson", n_jobs, cl, seed=0), cl, p) for p in ["fifo", "srtf", "doubling"]]
        plot_jct_cdf(rs, d / "sched_jct_cdf.png", title=f"poisson, {n_jobs} jobs on {cl.spec}")
        plot_timeline(rs[-1], d / "sched_timeline_doubling.png")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 40-job patterns, 1,000-job scale run")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--png", help="folder for a JCT CDF and an allocation timeline")
    args = ap.parse_args()
    bench(args.quick, args.json, args.png)


if __name__ == "__main__":
    main()
