"""Benchmark of the cluster job scheduler: average JCT of every policy on synthetic
patterns, Gavel traces and (--traces) production traces, on a homogeneous and a
three-type cluster, job lengths unknown to every policy but the oracle yardsticks;
hetrain's default policy (goodput) and the paper's doubling against fifo, the srtf
peer, the Gavel peer, the sia peer, adaptive and the per-decision optimum (the integer program solved exactly at every decision,
over the jobs the arrival-order (optimal) or the SRPT-order (optimal-srpt) admission
lets in); the scale test (1,000+ trace jobs on 900 GPUs); and the executor's workload
run for real on the local executor and on a Ray cluster (three Ray nodes on this host,
`ray.cluster_utils`) in the same run: real versus simulated average JCT (the simulator
charging the restart and cold-start costs measured on that backend), the costs
themselves, scheduling overhead per decision, and each job's fitted step time against
the measured one at every size it ran.

    python bench/sched.py --quick --json out.json
Simulations are deterministic, so each case runs once per seed; the table shows the
mean over seeds (3 seeds, 1 with --quick)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetrain.sched.cluster import parse_cluster_spec  # noqa: E402
from hetrain.sched.patterns import make_pattern  # noqa: E402
from hetrain.sched.job import use_goodput  # noqa: E402
from hetrain.sched.policies import DEFAULT_POLICY, get_policy  # noqa: E402
from hetrain.sched.public_traces import convert_public  # noqa: E402
from hetrain.sched.simulator import simulate  # noqa: E402
from hetrain.sched.trace import load_trace, parse_trace_lines  # noqa: E402
from traces_workloads import openb_one_round, trace_workloads  # noqa: E402
from pinned_pair import repo_env  # noqa: E402

CLUSTERS = {"homogeneous": "v100:24", "three-type": "v100:8,p100:8,k80:8"}
SMALL_CLUSTERS = {"homogeneous": "v100:8", "three-type": "v100:4,p100:4,k80:4"}
PATTERNS = ["all-at-once", "poisson", "bursts", "poisson-short", "all-at-once-long"]
TRACES = {"23dbec": None, "51b7ef": None, "0e4a51": None, "6214e9": 100}  # None: the pattern job count
# fixed-batch peers, then the goodput-aware ones (jobs run at their best batch)
PEERS = ["fifo", "srtf", "gavel", "doubling", "doubling-strict", "adaptive", "sia"]
ORACLES = ["srtf", "optimal", "optimal-srpt"]  # told true job lengths (yardsticks); every other policy is not
POLICIES = list(dict.fromkeys(PEERS + ["adaptive-goodput", "goodput", DEFAULT_POLICY]))
# --quick: the three-type cluster, two Gavel traces, no per-decision optima or small
# instances, the peers without the heuristic's variants (a few minutes on a loaded 2-core host)
QUICK_POLICIES = list(dict.fromkeys(["fifo", "srtf", "gavel", "doubling", "adaptive", "sia", DEFAULT_POLICY]))
QUICK_TRACES = {"23dbec": None, "6214e9": 100}
RATIO_POLICIES = list(dict.fromkeys(["doubling", "adaptive", "goodput", DEFAULT_POLICY]))
OPTIMA = ["optimal", "optimal-srpt"]  # per-decision MILP yardsticks (patterns, --quick)


def run_case(make, cluster, policy):
    return simulate(make(), cluster, policy)


def simulations(quick: bool, public: dict[str, Path] | None = None, public_jobs: int = 200,
                traces: Path | None = None) -> list[dict]:
    seeds = [0] if quick else [0, 1, 2]
    n_jobs = 40 if quick else 100
    cases = []
    policies = QUICK_POLICIES if quick else POLICIES
    clusters = {"three-type": CLUSTERS["three-type"]} if quick else CLUSTERS

    def add(workload, cname, cluster, policies, makers):
        for pol in policies:
            res = [run_case(m, cluster, pol) for m in makers]
            case = {"workload": workload, "cluster": cname, "cluster_spec": cluster.spec, "policy": pol,
                    "jobs": int(len(res[0].jct)), "seeds": len(makers),
                    "avg_jct_s": float(np.mean([r.avg_jct_s for r in res])),
                    "p99_jct_s": float(np.mean([r.p99_jct_s for r in res])),
                    "makespan_s": float(np.mean([r.makespan_s for r in res])),
                    "utilization": float(np.mean([r.utilization for r in res])),
                    "restarts": float(np.mean([r.restarts for r in res])),
                    "gpu_hours_per_job": float(np.mean([r.utilization * cluster.total * r.makespan_s / 3600 / len(r.jct)
                                                        for r in res])),
                    "oracle": pol in ORACLES,
                    "decision_ms": float(np.mean([1e3 * r.decision_wall_s / max(1, r.decisions) for r in res]))}
            cases.append(case)
            label = pol + ("*" if pol in ORACLES else "")
            print(f"{workload:<22}{cname:<12}{label:<16}{case['avg_jct_s'] / 3600:>10.3f}{case['p99_jct_s'] / 3600:>10.2f}"
                  f"{case['makespan_s'] / 3600:>10.2f}{case['utilization']:>6.2f}{case['restarts']:>9.1f}"
                  f"{case['decision_ms']:>8.2f}{case['gpu_hours_per_job']:>10.2f}", flush=True)

    print("lengths unknown to every policy but the oracles (marked *: srtf, optimal, optimal-srpt)")
    print(f"{'workload':<22}{'cluster':<12}{'policy':<16}{'avg JCT h':>10}{'p99 h':>10}{'mkspan h':>10}{'util':>6}"
          f"{'restarts':>9}{'ms/dec':>8}{'GPU-h/job':>10}")
    for cname, spec in clusters.items():
        cluster = parse_cluster_spec(spec)
        for pat in PATTERNS:
            makers = [lambda s=s, pat=pat: make_pattern(pat, n_jobs, cluster, seed=s) for s in seeds]
            add(pat, cname, cluster, policies + ([] if quick else OPTIMA), makers)
        for tr, limit in (QUICK_TRACES if quick else TRACES).items():
            makers = [lambda tr=tr, limit=limit: load_trace(tr, cluster, limit=limit or n_jobs)]
            add(f"trace:{tr}", cname, cluster, policies, makers)
        for kind, raw in (public or {}).items():  # a local copy of a public production trace
            lines = convert_public(kind, raw, limit=public_jobs)
            makers = [lambda lines=lines, kind=kind: parse_trace_lines(lines, cluster, source=kind)]
            add(kind, cname, cluster, policies, makers)
    for workload, cname, cluster, makers in trace_workloads(traces, quick) if traces else []:
        add(workload, cname, cluster, policies, makers)
    if quick:
        return cases
    # small instances: the exact optimum is the yardstick
    for cname, spec in SMALL_CLUSTERS.items():
        cluster = parse_cluster_spec(spec)
        for pat in ["all-at-once", "poisson", "bursts"]:
            makers = [lambda s=s, pat=pat: make_pattern(pat, 10, cluster, seed=s) for s in seeds]
            add(f"small:{pat}", cname, cluster, list(dict.fromkeys(["fifo", "srtf", "doubling", "adaptive",
                                                                    "adaptive-goodput", "goodput", DEFAULT_POLICY]))
                + OPTIMA, makers)
    return cases


def ratio_table(cases: list[dict]) -> list[dict]:
    def avg(w, c, p):
        for x in cases:
            if x["workload"] == w and x["cluster"] == c and x["policy"] == p:
                return x["avg_jct_s"]
        return None

    rows = []
    for w, c in dict.fromkeys((x["workload"], x["cluster"]) for x in cases):
        opt = [v for v in (avg(w, c, p) for p in OPTIMA) if v]
        best_opt = min(opt) if opt else None
        row = {"workload": w, "cluster": c}
        for pol in RATIO_POLICIES:
            mine = avg(w, c, pol)
            for peer, val in [(p, avg(w, c, p)) for p in PEERS + ["adaptive-goodput"] if p != pol] + \
                    [("optimum", best_opt)]:
                row[f"{pol}_over_{peer}"] = mine / val if mine and val else None
        rows.append(row)
    d = DEFAULT_POLICY
    cols = [f"{d}_over_optimum", f"{d}_over_srtf", f"{d}_over_gavel", f"{d}_over_sia", f"{d}_over_adaptive",
            f"{d}_over_adaptive-goodput", "doubling_over_optimum", "doubling_over_srtf"]
    print(f"\n{'workload':<22}{'cluster':<12}" + "".join(f"{c.replace('_over_', '/'):>19}" for c in cols))
    for r in rows:
        print(f"{r['workload']:<22}{r['cluster']:<12}" +
              "".join(f"{r[c]:>19.3f}" if r.get(c) else f"{'-':>19}" for c in cols))
    return rows


def scale(quick: bool, policies: list[str] | None = None) -> dict:
    big = parse_cluster_spec("300:300:300")
    n_big = 1000 if quick else 2000
    out = {}
    for pol in policies or list(dict.fromkeys([DEFAULT_POLICY, "adaptive", "doubling"])):
        jobs = load_trace("6214e9", big, limit=n_big)
        t0 = time.perf_counter()
        res = simulate(jobs, big, pol, progress=sys.stderr.isatty())
        wall = time.perf_counter() - t0
        out[pol] = {"jobs": len(jobs), "gpus": big.total, "wall_s": wall, "decisions": res.decisions,
                    "ms_per_decision": 1e3 * res.decision_wall_s / max(1, res.decisions), "avg_jct_s": res.avg_jct_s}
        print(f"scale: {len(jobs)} jobs on {big.total} GPUs, {pol}: {wall:.2f} s wall, {res.decisions} decisions, "
              f"{out[pol]['ms_per_decision']:.2f} ms/decision, avg JCT {res.avg_jct_s / 3600:.2f} h")
    return out


def one_round(repeats: int = 5) -> dict:
    """One decision for 500 active jobs on 2,000 GPUs of three types: from scratch (all
    jobs waiting) and again with the first decision's allocation running (restarts
    charged), median of `repeats` after a warm-up."""
    cluster = parse_cluster_spec("v100:700,p100:700,k80:600")
    out = {}
    for pol_name in list(dict.fromkeys([DEFAULT_POLICY, "goodput", "adaptive"])):
        pol = get_policy(pol_name)
        jobs = load_trace("6214e9", cluster, limit=500)
        use_goodput(jobs, getattr(pol, "adapts_batch", False))
        first = pol(jobs, cluster, {}, 0.0)  # warm-up (imports, caches)
        for j in jobs:
            j.started = j.job_id in first
        cold, warm = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pol(jobs, cluster, {}, 0.0)
            t1 = time.perf_counter()
            pol(jobs, cluster, first, 0.0)
            cold.append(t1 - t0)
            warm.append(time.perf_counter() - t1)
        out[pol_name] = {"jobs": len(jobs), "gpus": cluster.total, "cold_s": float(np.median(cold)),
                         "with_running_s": float(np.median(warm)), "running": len(first),
                         "gpus_given": int(sum(a.n for a in first.values()))}
        print(f"one round: {len(jobs)} jobs, {cluster.total} GPUs, {pol_name}: {out[pol_name]['cold_s']:.3f} s "
              f"(all waiting), {out[pol_name]['with_running_s']:.3f} s ({len(first)} running), median of {repeats}")
    return out


def _ray_cluster():
    """Three Ray nodes on this host; the two V100s (one per node) are a custom resource."""
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = repo_env()["PYTHONPATH"]  # Ray's processes import this tree
    small = {"object_store_memory": 75 * 2**20, "num_cpus": 2}
    c = Cluster(initialize_head=True, head_node_args={**small, "resources": {"emu_gpu": 1, "accelerator_type:V100": 1}})
    c.add_node(**small, resources={"emu_gpu": 1, "accelerator_type:V100": 1})
    c.add_node(**small)
    c.wait_for_nodes()
    return c


def executor_runs() -> tuple[dict | None, dict | None, list | None]:
    try:
        from hetrain.sched.executor import Backend, bench_sim_vs_real
    except ImportError:
        print("sim vs real: executor not available in this checkout")
        return None, None, None
    from hetrain.sched.executor import fit_sweep

    print("\nfitted ring curve vs measured step time, one job run at each size (local, 0.4 s compute/batch)")
    sweep = fit_sweep()
    print(f"  {'GPUs':>5}{'steps':>7}{'measured s':>12}{'compute s':>11}{'comm s':>9}{'fitted s':>10}{'error':>8}"
          f"{'fit w/o this size':>19}{'error':>8}")
    for r in sweep:
        print(f"  {r['gpus']:>5}{r['steps']:>7}{r['measured_s']:>12.4f}{r['compute_s']:>11.4f}{r['comm_s']:>9.4f}"
              f"{r['fitted_s']:>10.4f}{r['fitted_s'] / r['measured_s'] - 1:>+8.1%}{r['left_out_s']:>19.4f}"
              f"{r['left_out_s'] / r['measured_s'] - 1:>+8.1%}")
    print("\nexecutor workload (3 real jobs), policy", DEFAULT_POLICY)
    local = bench_sim_vs_real(cluster_spec="cpu:2")
    _print_real("local", local)
    try:
        import ray  # noqa: F401
    except ImportError:
        print("ray: not installed (pip install 'hetrain[ray]'); skipped")
        return local, None, sweep
    c = _ray_cluster()
    try:
        backend = Backend("ray", address=c.address, gpu_resource="emu_gpu", cpus_per_process=0.5)
        on_ray = bench_sim_vs_real(backend=backend, cluster_spec=None)  # pools read from the Ray cluster
    finally:
        import ray

        ray.shutdown()
        c.shutdown()
    _print_real("ray", on_ray)
    return local, on_ray, sweep


def _print_real(name: str, out: dict) -> None:
    print(f"{name:<6} pool {out['cluster']}: real avg JCT {out['real_s']:.2f} s, simulated {out['sim_s']:.2f} s "
          f"(sim/real {out['ratio']:.3f}); {out['real']['restarts']} restarts, restart {out['restart_s']:.2f} s, "
          f"cold start {out['start_s']:.2f} s, teardown {out['finish_s']:.2f} s, {out['decision_ms']:.1f} ms per decision")
    print(f"  {'job':<5}{'GPUs':>10}{'steps':>7}{'measured s':>12}{'fitted s':>10}{'error':>8}{'predicted before':>18}")
    for row in out["real"]["step_times"]:
        err = row["fitted_s"] / row["measured_s"] - 1
        before = row["predicted_before_s"]
        print(f"  {row['job']:<5}{str(row['gpus']) + ' ' + row['gpu_type']:>10}{row['steps']:>7}"
              f"{row['measured_s']:>12.4f}{row['fitted_s']:>10.4f}{err:>+8.1%}"
              f"{(f'{before:.4f}' if before else '-'):>18}")


def _summary(out: dict | None) -> dict | None:
    if out is None:
        return None
    errs = [abs(r["fitted_s"] / r["measured_s"] - 1) for r in out["real"]["step_times"]]
    return {"sim_s": out["sim_s"], "real_s": out["real_s"], "ratio": out["ratio"], "restart_s": out["restart_s"],
            "start_s": out["start_s"], "finish_s": out["finish_s"], "decision_ms": out["decision_ms"], "restarts": out["real"]["restarts"],
            "cluster": out["cluster"], "policy": out["policy"], "restart_costs_s": out["real"]["restart_costs_s"],
            "start_costs_s": out["real"]["start_costs_s"], "finish_costs_s": out["real"]["finish_costs_s"], "jct_s": out["real"]["jct_s"], "sim_jct_s": out["sim"]["jct_s"],
            "fits": out["real"]["fits"], "step_times": out["real"]["step_times"],
            "worst_fit_error": max(errs) if errs else None}


def bench(quick: bool, out_json: str | None, png_dir: str | None, skip_real: bool = False,
          public: dict[str, Path] | None = None, public_jobs: int = 200, scale_policies: list[str] | None = None,
          traces: Path | None = None) -> dict:
    cases = simulations(quick, public, public_jobs, traces)
    ratios = ratio_table(cases)
    print()
    rnd = one_round()
    openb_rnd = openb_one_round(traces, list(dict.fromkeys([DEFAULT_POLICY, "sia"]))) if traces else {}
    sc = scale(quick, scale_policies or ([DEFAULT_POLICY] if quick else None))
    local, on_ray, sweep = (None, None, None) if skip_real else executor_runs()
    pats = [r for r in ratios if r["workload"] in PATTERNS or r["workload"].startswith("small:")]
    three_traces = [r for r in ratios if r["workload"].startswith("trace:") and r["cluster"] == "three-type"]
    d = DEFAULT_POLICY
    def worst(vals, pick=max):
        vals = [v for v in vals if v]
        return pick(vals) if vals else None

    worst_over = {p: worst(r.get(f"{d}_over_{p}") for r in ratios) for p in PEERS + ["adaptive-goodput"] if p != d}
    worst_over = {p: v for p, v in worst_over.items() if v is not None}
    trace_rows = [r for r in ratios if r["workload"].startswith(("openb:", "philly:"))]
    checks = {
        "default_policy": d,
        f"worst_{d}_over_each_peer": worst_over,
        f"{d}_no_worse_than_every_peer_everywhere": all(v <= 1.0 + 1e-9 for p, v in worst_over.items()
                                                        if p in PEERS and p not in ORACLES),
        "oracle_peers": ORACLES,
        f"worst_{d}_over_each_peer_production_traces": {p: worst(r.get(f"{d}_over_{p}") for r in trace_rows)
                                                         for p in PEERS if p != d},
        "one_round_openb_6212_gpus_2000_jobs_s": {p: {"cold": v["cold_s"], "next_decision": v["next_decision_s"]}
                                                  for p, v in openb_rnd.items()},
        "one_round_openb_next_decision_under_1s": openb_rnd[d]["next_decision_s"] < 1.0 if openb_rnd else None,
        "one_round_openb_cold_under_1s": openb_rnd[d]["cold_s"] < 1.0 if openb_rnd else None,
        "one_round_2000_gpus_500_jobs_s": {p: max(v["cold_s"], v["with_running_s"]) for p, v in rnd.items()},
        "one_round_under_1s": max(rnd[d]["cold_s"], rnd[d]["with_running_s"]) < 1.0,
        "sim_1000_jobs_wall_s": {p: v["wall_s"] for p, v in sc.items()},
        f"worst_{d}_over_optimum_patterns": worst(r.get(f"{d}_over_optimum") for r in pats),
        f"worst_{d}_over_srtf": worst(r.get(f"{d}_over_srtf") for r in ratios),
        f"worst_{d}_over_gavel_three_type_traces": worst(r.get(f"{d}_over_gavel") for r in three_traces),
        "worst_doubling_over_optimum_patterns": worst(r.get("doubling_over_optimum") for r in pats),
        "worst_doubling_over_srtf": worst(r.get("doubling_over_srtf") for r in ratios),
        "best_doubling_over_fifo": worst((r.get("doubling_over_fifo") for r in ratios), min),
        "scale_under_60s": {p: v["wall_s"] < 60 for p, v in sc.items()},
        "local_sim_over_real": local["ratio"] if local else None,
        "ray_sim_over_real": on_ray["ratio"] if on_ray else None,
        "worst_fit_error_scheduled_runs": max([s["worst_fit_error"] for s in map(_summary, (local, on_ray)) if s and
                                               s["worst_fit_error"] is not None] or [None]) if (local or on_ray) else None,
        "worst_fit_error_sweep": max(abs(r["fitted_s"] / r["measured_s"] - 1) for r in sweep) if sweep else None,
        "worst_left_out_error_sweep": max(abs(r["left_out_s"] / r["measured_s"] - 1) for r in sweep) if sweep else None,
    }
    print("\nchecks:", json.dumps(checks, indent=1))
    out = {"default_policy": d, "lengths": "unknown to every policy but the oracles", "cases": cases,
           "ratios": ratios, "scale": sc, "one_round": rnd, "one_round_openb": openb_rnd,
           "sim_vs_real": _summary(local), "ray": _summary(on_ray), "fit_sweep": sweep, "checks": checks}
    if out_json:
        Path(out_json).write_text(json.dumps(out, indent=1))
        print(f"wrote {out_json}")
    if png_dir:
        from hetrain.sched.plots import plot_jct_cdf, plot_timeline
        pd = Path(png_dir)
        pd.mkdir(parents=True, exist_ok=True)
        cl = parse_cluster_spec(CLUSTERS["three-type"])
        n = 40 if quick else 100
        rs = [simulate(make_pattern("poisson", n, cl, seed=0), cl, p) for p in ["fifo", "srtf", "gavel", "doubling", d]]
        plot_jct_cdf(rs, pd / "sched_jct_cdf.png", title=f"poisson, {n} jobs on {cl.spec}")
        plot_timeline(rs[-1], pd / f"sched_timeline_{d}.png")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 40-job patterns, 1,000-job scale run")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--png", help="folder for a JCT CDF and an allocation timeline")
    ap.add_argument("--no-real", action="store_true", help="simulations only (no real jobs, local or on Ray)")
    ap.add_argument("--philly", type=Path, help="a local copy of Philly's cluster_job_log (JSON), run as a workload")
    ap.add_argument("--helios", type=Path, help="a local copy of a Helios cluster_log.csv, run as a workload")
    ap.add_argument("--traces", type=Path, help="folder with alibaba-openb-2023/ and philly-runtimes/: adds the "
                    "openb:* and philly:* workloads and the one-round time on the whole OpenB cluster")
    ap.add_argument("--public-jobs", type=int, default=200, help="jobs taken from each public trace (default 200)")
    ap.add_argument("--scale-policies", help="policies of the 1,000-job scale run, comma-separated "
                    "(default: the default policy, adaptive, doubling)")
    args = ap.parse_args()
    public = {k: v for k, v in (("philly", args.philly), ("helios", args.helios)) if v is not None}
    bench(args.quick, args.json, args.png, skip_real=args.no_real, public=public, public_jobs=args.public_jobs,
          scale_policies=args.scale_policies.split(",") if args.scale_policies else None, traces=args.traces)


if __name__ == "__main__":
    main()
