"""Placement benchmark: every planner on the model zoo x catalogues x targets.

For each zoo model (profiled once on this host) x catalogue (aws, gcp) x three targets
(fractions of the best throughput any plan can reach there), runs every planner and
records the run cost, throughput, planning time and feasibility; prints the rl/exact cost
ratio, and the best plan against all-on-the-cheapest-GPU and all-on-CPU plans beside
HeterPS's headline (14.5x throughput, 312.3% lower cost). Also times rl and exact on the
200-layer transformer.

    python bench/plan.py --quick --json out.json
    python bench/plan.py --quick --profiles out.json   # replay on the profiles out.json used
    python bench/plan.py --whole-job --quick --json out.json   # the whole-job section (bench/plan_job.py)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hetrain.plan.base import Problem  # noqa: E402
from hetrain.plan.planners import get_planner  # noqa: E402
from hetrain.plan.catalogue import load_catalogue  # noqa: E402
from hetrain.plan.exact import max_throughput  # noqa: E402
from hetrain.plan.profile import ModelProfile, load_or_profile  # noqa: E402

PLANNERS = ("exact", "rl", "genetic", "greedy", "gpu", "cpu")
FRACTIONS = (0.1, 0.4, 0.8)
HEADLINE = {"throughput_x": 14.5, "cost_lower_pct": 312.3}


def fnum(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def profiles(models, source: Path | None, quick: bool) -> dict[str, ModelProfile]:
    """The models' layer profiles: from `source` where given, else measured afresh on this
    host. `source` is a results JSON of this bench (its `profiles`: a run replayed on the
    profiles it used, so a planner's miss can be reproduced) or a folder of
    `profile_<model>.json` files, filled with fresh profiles where one is missing."""
    kept: dict = {}
    if source is not None and source.suffix == ".json":
        if not source.is_file():
            raise SystemExit(f"--profiles {source}: no such file (give a results JSON of bench/plan.py or a folder)")
        kept = json.loads(source.read_text()).get("profiles") or {}
        missing = [m for m in models if m not in kept]
        if missing:
            raise SystemExit(f"--profiles {source}: no profiles of {missing} in it (it has {sorted(kept)}); "
                             "pass --models with those it has")
        return {m: ModelProfile.model_validate(kept[m]) for m in models}
    out = {}
    for m in models:
        path = source / f"profile_{m}.json" if source else None
        if path is not None and path.is_file():
            out[m] = ModelProfile.load(path)
        else:
            out[m] = load_or_profile(m, batch=32, repeats=3 if quick else 7)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                out[m].save(path)
    return out


def run_planner(name: str, problem: Problem, repeats: int, seed: int = 0):
    """Run a planner `repeats` times (rl/genetic with seeds seed, seed+1, ...); returns the
    WORST result (conservative: no best-of-seeds picking), the median time, all times."""
    times, worst = [], None
    for rep in range(repeats):
        kw = {"progress": False} if name == "rl" else {}
        if name in ("rl", "genetic"):
            kw["seed"] = seed + rep
        r = get_planner(name, **kw).plan(problem)
        times.append(r.plan_s)
        key = r.score.hourly if r.feasible else np.inf
        if worst is None or key > (worst.score.hourly if worst.feasible else np.inf):
            worst = r
    return worst, statistics.median(times), times


def print_summary(ratios: list[dict], headline: list[dict], timing: dict) -> None:
    """The closing summary: RL against exact cost per case, the best heterogeneous plan
    against the homogeneous ones, and the 200-layer planning time."""
    print("\nrl cost / exact cost on feasible cases:")
    vals = [r["rl_over_exact"] if r["rl_over_exact"] is not None else np.inf for r in ratios]
    for r in ratios:
        pol = f"{r['policy_over_exact']:.3f}" if r["policy_over_exact"] else "infeasible"
        rl = f"{r['rl_over_exact']:.3f}" if r["rl_over_exact"] else "infeasible"
        print(f"  {r['model']:12s} {r['catalogue']:4s} {r['target_frac']:4.0%}: rl {rl}"
              f"  (before the final local polish {pol})  exact cheapest of all: {r['exact_is_min']}")
    if vals:
        print(f"  max {max(vals):.3f}, median {statistics.median(vals):.3f}, equal to exact in "
              f"{sum(v <= 1 + 1e-9 for v in vals)}/{len(vals)}, within 1.05 in {sum(v <= 1.05 for v in vals)}/{len(vals)}")
    print("\nbest heterogeneous plan vs homogeneous plans (HeterPS headline: "
          f"{HEADLINE['throughput_x']}x throughput, {HEADLINE['cost_lower_pct']}% lower cost):")
    for h in headline:
        def r(a, b):
            return f"{a / b:.2f}x" if a and b else "n/a"
        print(f"  {h['model']:12s} {h['catalogue']:4s} max samples/s: best {h['best_throughput']:,.0f}, "
              f"all-GPU {h['all_gpu_throughput']:,.0f} ({r(h['best_throughput'], h['all_gpu_throughput'])}), "
              f"all-CPU {h['all_cpu_throughput']:,.0f} ({r(h['best_throughput'], h['all_cpu_throughput'])}); "
              f"cost at {h['target']:,.0f}/s: best ${h['best_cost']:.2f}, all-GPU "
              f"{'$%.2f' % h['all_gpu_cost'] if h['all_gpu_cost'] else 'infeasible'} "
              f"({'%.0f%% higher' % (100 * (h['all_gpu_cost'] / h['best_cost'] - 1)) if h['all_gpu_cost'] else '-'}), "
              f"all-CPU {'$%.2f' % h['all_cpu_cost'] if h['all_cpu_cost'] else 'infeasible'} "
              f"({'%.0f%% higher' % (100 * (h['all_cpu_cost'] / h['best_cost'] - 1)) if h['all_cpu_cost'] else '-'})")
    print(f"\n200-layer transformer (aws, target {timing['target']:,.0f}/s): exact {timing['exact_s']:.2f} s, "
          f"rl {timing['rl_s']:.2f} s (rl/exact cost {timing['rl_over_exact']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, fewer profile repeats")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--profiles", default=None,
                    help="layer profiles to use instead of profiling afresh: a results JSON of this bench (replays "
                         "the run on the profiles it used) or a folder to cache/reuse profile_<model>.json files")
    ap.add_argument("--models", default="ctr,cnn,transformer")
    ap.add_argument("--catalogues", default="aws,gcp")
    ap.add_argument("--whole-job", action="store_true",
                    help="the whole-job section instead: plans picked and predicted vs measured on 6 emulated "
                         "clusters (bench/plan_job.py; --json goes there)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="with --whole-job: interleaved runs per candidate (quick 1, else 3)")
    args = ap.parse_args(argv)
    if args.whole_job:
        from plan_job import main as whole_job

        return whole_job((["--quick"] if args.quick else []) + (["--json", args.json] if args.json else [])
                         + (["--repeats", str(args.repeats)] if args.repeats else []))
    repeats = 1 if args.quick else 3
    models = args.models.split(",")
    cats = {c: load_catalogue(c) for c in args.catalogues.split(",")}
    t0 = time.perf_counter()
    profs = profiles(models + ["transformer200"], Path(args.profiles) if args.profiles else None, args.quick)
    print(f"profiled {len(profs)} models in {time.perf_counter() - t0:.1f} s", flush=True)

    cases, ratios, headline = [], [], []
    for m in models:
        for cname, cat in cats.items():
            w = profs[m].workload(cat)
            base = Problem(w, 1.0)
            best_thr, _ = max_throughput(base)
            for frac in FRACTIONS:
                problem = base.with_target(best_thr * frac)
                row = {}
                for pname in PLANNERS:
                    r, med, times = run_planner(pname, problem, repeats if pname in ("exact", "rl") else 1)
                    cost = problem.run_cost(r.score) if r.feasible else float("inf")
                    row[pname] = (r, cost)
                    cases.append({"model": m, "catalogue": cname, "target": problem.target, "target_frac": frac,
                                  "planner": pname, "cost": fnum(cost), "price_per_hour": fnum(r.score.hourly),
                                  "throughput": r.score.throughput, "plan_s": med, "plan_s_all": times,
                                  "feasible": r.feasible, "stages": len(r.score.stages),
                                  "policy_cost": fnum(problem.run_cost_hourly(r.info["policy_hourly"]))
                                  if pname == "rl" and "policy_hourly" in r.info else None})
                ex_cost = row["exact"][1]
                if np.isfinite(ex_cost):
                    rl_ratio = row["rl"][1] / ex_cost
                    pol = cases[-len(PLANNERS) + 1]["policy_cost"]
                    ratios.append({"model": m, "catalogue": cname, "target_frac": frac, "rl_over_exact": fnum(rl_ratio),
                                   "policy_over_exact": fnum(pol / ex_cost) if pol else None,
                                   "exact_is_min": all(ex_cost <= c * (1 + 1e-9) for _, c in row.values())})
                line = "  ".join(f"{p}={row[p][1]:.2f}" if np.isfinite(row[p][1]) else f"{p}=inf" for p in PLANNERS)
                print(f"{m:12s} {cname:4s} target {problem.target:12,.0f} ({frac:.0%})  $/run: {line}  "
                      f"[exact {cases[-6]['plan_s']:.3f}s rl {cases[-5]['plan_s']:.2f}s]", flush=True)
            # headline: best heterogeneous plan vs homogeneous ones
            gpu_a = get_planner("gpu").solve(base)[0]
            cpu_a = get_planner("cpu").solve(base)[0]
            gpu_thr = max_throughput(base, gpu_a)[0] if gpu_a else 0.0
            cpu_thr = max_throughput(base, cpu_a)[0] if cpu_a else 0.0
            low = base.with_target(best_thr * FRACTIONS[0])
            c_best = low.run_cost(get_planner("exact").plan(low).score)
            c_gpu = low.evaluate(gpu_a)
            c_cpu = low.evaluate(cpu_a)
            headline.append({
                "model": m, "catalogue": cname, "best_throughput": best_thr, "all_gpu_throughput": gpu_thr,
                "all_cpu_throughput": cpu_thr,
                "throughput_x_vs_gpu": fnum(best_thr / gpu_thr) if gpu_thr else None,
                "throughput_x_vs_cpu": fnum(best_thr / cpu_thr) if cpu_thr else None,
                "target": low.target, "best_cost": c_best,
                "all_gpu_cost": fnum(low.run_cost(c_gpu)) if c_gpu.feasible else None,
                "all_cpu_cost": fnum(low.run_cost(c_cpu)) if c_cpu.feasible else None,
            })

    # 200-layer planning time
    w200 = profs["transformer200"].workload(cats["aws"] if "aws" in cats else next(iter(cats.values())))
    b200 = Problem(w200, 1.0)
    thr200, _ = max_throughput(b200)
    p200 = b200.with_target(0.4 * thr200)
    ex200, ex_s, ex_all = run_planner("exact", p200, repeats)
    rl200, rl_s, rl_all = run_planner("rl", p200, repeats)
    timing = {"layers": w200.n_layers, "target": p200.target, "exact_s": ex_s, "rl_s": rl_s,
              "exact_s_all": ex_all, "rl_s_all": rl_all,
              "rl_over_exact": fnum(rl200.score.hourly / ex200.score.hourly) if ex200.feasible else None}

    print_summary(ratios, headline, timing)
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": cases, "rl_ratios": ratios, "headline": headline,
                                               "heterps_headline": HEADLINE, "timing_200_layers": timing,
                                               "quick": args.quick, "profiles_from": args.profiles,
                                               "profiles": {m: p.model_dump(mode="json") for m, p in profs.items()}},
                                              indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
