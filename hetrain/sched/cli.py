"""`hetrain schedule simulate|run`: cluster scheduling of ring all-reduce jobs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import UserError
from .policies import DEFAULT_POLICY


def register(subparsers) -> None:
    p = subparsers.add_parser("schedule", help="schedule many data-parallel jobs on a shared GPU cluster")
    sub = p.add_subparsers(dest="schedule_command", metavar="ACTION")
    s = sub.add_parser("simulate", help="simulate a trace or a synthetic pattern under one or more policies")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Gavel/Philly trace file (tab-separated, one job a line), or the name of a shipped trace (e.g. 6214e9)")
    src.add_argument("--pattern", help="synthetic arrivals: all-at-once, poisson, bursts[-short|-long|-mixed]")
    s.add_argument("--cluster", default="v100:8,p100:8,k80:8",
                   help="GPU pools, e.g. v100:8,p100:8,k80:8, Gavel's 300:300:300, or a YAML file: `gpus: {v100: 8}`, "
                        "a launcher cluster file (its GPU machines by device kind) or a catalogue (its GPU types)")
    s.add_argument("--policy", default=DEFAULT_POLICY,
                   help="policy name, or several separated by commas (goodput, adaptive, adaptive-goodput, fifo, "
                        "srtf, gavel, doubling, doubling-strict, optimal)")
    s.add_argument("--jobs", type=int, default=50, help="jobs in a synthetic pattern, or the first N of a trace")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--load", type=float, default=1.0, help="offered load of poisson/bursts patterns (x cluster)")
    s.add_argument("--restart-cost", type=float, default=10.0, help="seconds a stop + restart costs a job")
    s.add_argument("--throughputs", help="simulation_throughputs.json (default: the copy shipped in hetrain/data/gavel)")
    s.add_argument("--out", help="folder for jct_cdf.png, timeline_<policy>.png and summary.json")
    s.add_argument("--lengths", choices=["unknown", "known"], default="unknown",
                   help="whether policies are told each job's remaining work (default unknown, as in production; "
                        "srtf and optimal are always told)")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=_simulate)
    r = sub.add_parser("run", help="run a small workload of real training jobs under a policy")
    r.add_argument("--policy", default=DEFAULT_POLICY)
    r.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local: processes on this host (emulated GPU pool); ray: GPUs of a Ray cluster")
    r.add_argument("--address", help="ray: the cluster's GCS address HOST:PORT, or auto")
    r.add_argument("--ray-gpu-resource", default="GPU", help="ray: the resource that counts GPUs (default GPU)")
    r.add_argument("--cluster", help="GPU pools, e.g. cpu:2 (local default: one process per emulated GPU); "
                                     "ray default: the Ray cluster's GPUs by accelerator type")
    r.add_argument("--workdir", default="sched-run", help="checkpoints and logs go here")
    r.add_argument("--json", help="write the measured and simulated JCTs here")
    r.set_defaults(func=_run)
    p.set_defaults(func=lambda args: p.error("choose an action: simulate or run"))


def _workload(args, cluster):
    from .patterns import make_pattern
    from .trace import load_trace

    if args.jobs < 1:
        raise UserError("--jobs must be >= 1")
    if args.trace:
        return lambda: load_trace(args.trace, cluster, restart_cost=args.restart_cost,
                                  throughputs=args.throughputs, limit=args.jobs)
    return lambda: make_pattern(args.pattern, args.jobs, cluster, seed=args.seed, load=args.load,
                                restart_cost=args.restart_cost, throughputs=args.throughputs)


def _simulate(args) -> int:
    from .cluster import parse_cluster_spec
    from .plots import plot_jct_cdf, plot_timeline
    from .policies import get_policy
    from .simulator import simulate

    cluster = parse_cluster_spec(args.cluster)
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    pols = [get_policy(n) for n in names]
    make = _workload(args, cluster)
    make()  # parse once up front so input errors surface before any simulation
    results = []
    show = not args.no_progress and sys.stderr.isatty()
    print(f"{'policy':<16}{'avg JCT h':>10}{'p99 JCT h':>10}{'makespan h':>11}{'util':>6}{'restarts':>9}"
          f"{'ms/decision':>12}")
    for name, pol in zip(names, pols):
        res = simulate(make(), cluster, pol, progress=show, lengths=args.lengths)
        s = res.summary()
        results.append(res)
        print(f"{name:<16}{s['avg_jct_s'] / 3600:>10.3f}{s['p99_jct_s'] / 3600:>10.3f}{s['makespan_s'] / 3600:>11.2f}"
              f"{s['utilization']:>6.2f}{s['restarts']:>9d}{s['decision_ms']:>12.2f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot_jct_cdf(results, out / "jct_cdf.png", title=f"{args.trace or args.pattern} on {cluster.spec}")
        for r in results:
            plot_timeline(r, out / f"timeline_{r.policy}.png")
        (out / "summary.json").write_text(json.dumps([r.summary() for r in results], indent=1))
        print(f"wrote {out}/jct_cdf.png, timeline_*.png, summary.json")
    return 0


def _run(args) -> int:
    from .executor import run_cli

    return run_cli(args)
