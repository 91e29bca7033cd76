"""HeterPS runtime benchmark: the CTR model on an emulated cluster of CPU machines and
two GPU kinds, for the exact plan, the all-GPU plan and the all-CPU plan.

For each plan: measured samples/s (median of repeats) beside the cost model's
prediction, $/hour from the catalogue, measured $ per million samples and $ for a
training run of N samples at the measured rate. Then AUC after a fixed number of
samples: the pipeline (exact plan, real processes, sparse PS) versus a single-process
run of the same model on the same data, with the hidden model's AUC ceiling.

What is emulated: every micro-batch occupies its stage replica for the cost model's
per-sample time of that stage (compute from the layer profile and the catalogue's
speed per layer kind, plus activation transfer over the type's NIC) and every step's
dense all-reduce for the ring time; the real math, the real gloo transfers and the
real sparse-PS traffic run underneath (docs/heterps-runtime.md).

    python bench/heterps.py --quick --json out.json

`--real` measures the runtime on this host's real devices instead (a GPU and CPU workers
of N threads; hetrain/pipeline/measure.py): it profiles the runtime's model on both at a
few micro-batch sizes and keeps the fastest (a GPU is launch-bound at small ones),
builds a catalogue of this host, runs the all-GPU and all-CPU plans as calibration (each
type's measured cost beyond the profile), plans exactly on the calibrated profile for a
target that needs the GPU where it helps, runs that plan without padding and reports
measured vs predicted throughput (fill and drain included) and cost, and the AUC of the
pipeline vs one process. Without CUDA it exits 0 saying so (`--cpu-dry-run` runs the
flow with the CPU standing in for the GPU).

    PYTHONPATH=. python bench/heterps.py --real --json heterps_real.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetrain.perf.pipeline import CostParams  # noqa: E402
from hetrain.pipeline.cli import run_plan  # noqa: E402
from hetrain.pipeline.data import CTRData  # noqa: E402
from hetrain.pipeline.reference import assemble, evaluate_auc, train_single  # noqa: E402
from hetrain.pipeline.workload import CATALOGUE, emulated_profile  # noqa: E402
from hetrain.plan.base import Problem  # noqa: E402
from hetrain.plan.planners import get_planner  # noqa: E402
from hetrain.plan.catalogue import load_catalogue  # noqa: E402
from hetrain.plan.render import plan_to_dict  # noqa: E402

PLANS = (("exact", "exact"), ("all-gpu", "gpu"), ("all-cpu", "cpu"))


def print_table(cases: list[dict], auc: dict, args, steps: int, catalogue: str) -> None:
    """The emulated runs' table: measured against predicted per plan, prices, the AUC check."""
    w = max(len(c["plan"]) for c in cases)
    print(f"\nHeterPS runtime, ctr-small on {catalogue}: target {args.target:,.0f} samples/s, batch {args.batch}, "
          f"{args.micro_batches} micro-batches/step, {steps} steps (1 warm-up), median of {args.repeats}")
    print(f"{'plan':<{w}}  {'stages':<40} {'procs':>5} {'measured':>9} {'predicted':>9} {'error':>7} "
          f"{'$/hour':>7} {'$/1M samples':>12} {'$/run':>8} {'late slots':>10}")
    for c in cases:
        print(f"{c['plan']:<{w}}  {' '.join(c['stages']):<40} {c['processes']:>5} {c['measured_sps']:>9,.1f} "
              f"{c['predicted_sps']:>9,.1f} {c['error'] * 100:>+6.1f}% {c['price_per_hour']:>7.2f} "
              f"{c['cost_per_million']:>12.3f} {c['cost']:>8.2f} {statistics.median(c['over_target']):>10.0f}")
    best = min(cases, key=lambda c: c["cost_per_million"])
    print(f"cheapest measured per sample: {best['plan']}; run = {args.samples:,.0g} samples")
    print(f"AUC after {auc['samples']:,} samples: pipeline {auc['pipeline']:.4f}, single process {auc['single']:.4f} "
          f"(diff {auc['pipeline'] - auc['single']:+.4f}); ceiling (hidden model) {auc['ceiling']:.4f}")
    print("emulated: per-micro-batch compute+transfer and all-reduce times come from the cost model's profile "
          "(sleep-padded); real: the math, gloo messages, sparse PS. 'late slots': micro-batches whose real work "
          "on the shared host overran the emulated time (host contention; they make 'measured' lower).")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (still 3 repeats)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--target", type=float, default=None,
                    help="throughput target of the plans (samples/s; 1000, or with --real one that needs the GPU where it "
                         "helps: halfway between the CPUs alone and the best reachable)")
    ap.add_argument("--batch", type=int, default=None, help="global batch per step (2048; --real: 65536)")
    ap.add_argument("--micro-batches", type=int, default=None, help="per step (64; --real: 32, also tried /4 and /16)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per plan (3; --real: 2)")
    ap.add_argument("--samples", type=float, default=1e8, help="samples in the priced training run")
    ap.add_argument("--auc-steps", type=int, default=None, help="steps of the AUC runs")
    ap.add_argument("--real", action="store_true", help="this host's real GPU and CPU instead of the emulated cluster")
    ap.add_argument("--cpu-threads", type=int, default=4, help="--real: threads (own cores) of a CPU worker (4)")
    ap.add_argument("--gpu-price", type=float, default=None, help="--real: $/hour of the GPU (default: list price)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="--real without CUDA: the CPU stands in for the GPU (checks the flow; figures meaningless)")
    args = ap.parse_args()
    if args.real:
        return real(args)
    args.target = args.target or 1000.0
    args.micro_batches = args.micro_batches or 64
    args.batch = args.batch or 2048
    args.repeats = args.repeats or 3
    steps = 4 if args.quick else 8
    auc_steps = args.auc_steps or (24 if args.quick else 60)
    work = Path(tempfile.mkdtemp(prefix="bench-heterps-"))

    profile = emulated_profile()
    cat = load_catalogue(CATALOGUE)
    problem = Problem(profile.workload(cat), args.target, CostParams(batch_size=args.batch), args.samples)
    plans = {}
    for label, planner in PLANS:
        res = get_planner(planner).plan(problem)
        if not res.feasible:
            print(f"{label} plan infeasible: {res.score.reason}", file=sys.stderr)
            return 1
        plans[label] = plan_to_dict(problem, res, profile.model, cat.name)

    cases = []
    for label, plan in plans.items():
        runs = []
        for rep in range(args.repeats):
            r = run_plan(plan, run_dir=str(work / f"{label}-{rep}"), quiet=True, steps=steps, warmup_steps=1,
                         micro_batches=args.micro_batches)
            if r["rc"] != 0:
                print(f"{label} run {rep} failed; logs in {r['run_dir']}", file=sys.stderr)
                return 1
            runs.append(r)
            print(f"  {label} repeat {rep}: measured {r['measured_sps']:,.1f} samples/s, "
                  f"predicted {r['predicted_sps']:,.1f}", flush=True)
        meas = statistics.median(r["measured_sps"] for r in runs)
        pred = runs[0]["predicted_sps"]
        hourly = runs[0]["price_per_hour"]
        cases.append({
            "plan": label,
            "stages": [f"{s['layers'][0]}-{s['layers'][1] - 1}:{s['type']}x{s['instances']}" for s in runs[0]["stages"]],
            "processes": runs[0]["processes"],
            "measured_sps": meas, "measured_runs": [r["measured_sps"] for r in runs],
            "predicted_sps": pred, "error": meas / pred - 1,
            "price_per_hour": hourly,
            "cost": hourly * args.samples / meas / 3600.0,            # $ for the run at the measured rate
            "predicted_cost": hourly * args.samples / pred / 3600.0,
            "cost_per_million": hourly / 3600.0 / meas * 1e6,
            "plan_cost_at_target": plan["cost_per_run"],
            # slots where real work on the shared host took longer than the emulated time
            "over_target": [r["over_target"] for r in runs],
        })

    # AUC: the exact plan as a real pipeline (no time padding) vs one process, same data
    r = run_plan(plans["exact"], run_dir=str(work / "auc"), quiet=True, steps=auc_steps, warmup_steps=1,
                 micro_batches=args.micro_batches, emulate=False)
    if r["rc"] != 0:
        print(f"AUC pipeline run failed; logs in {r['run_dir']}", file=sys.stderr)
        return 1
    from hetrain.pipeline.spec import RunSpec
    spec = RunSpec.load(Path(r["run_dir"]) / "spec.json")
    single = train_single(spec)
    auc = {"pipeline": evaluate_auc(assemble(spec, spec.steps), spec), "single": evaluate_auc(single, spec),
           "ceiling": CTRData(spec.data).ceiling_auc, "samples": spec.steps * spec.batch}

    print_table(cases, auc, args, steps, cat.name)
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": cases, "auc": auc, "target": args.target,
                                               "batch": args.batch, "steps": steps,
                                               "repeats": args.repeats}, indent=1))
        print(f"wrote {args.json}")
    return 0


def real(args) -> int:
    """--real: measured vs predicted on this host's devices (hetrain/pipeline/measure.py)."""
    import torch

    from hetrain.pipeline.measure import measure_real, table, to_json

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("bench/heterps.py --real: skipped, needs CUDA (this host has no CUDA device)")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": "needs CUDA"}))
        return 0
    kw = dict(target=args.target, cpu_threads=args.cpu_threads, samples=args.samples, gpu_price=args.gpu_price,
              cpu_dry_run=args.cpu_dry_run)
    if args.micro_batches:
        kw["micro_batches"] = args.micro_batches
    if args.batch:
        kw["batch"] = args.batch
    if args.repeats:
        kw["repeats"] = args.repeats
    if args.quick:
        kw.update(steps=4, warmup_steps=1)
    res = measure_real(**kw)
    print()
    print(table(res))
    print("measured: real devices, no padding (GPU stages on CUDA, CPU stages on cores of their own, sparse PS "
          "shards on the CPU); predicted: the cost model on layer times measured on the same devices")
    if args.json:
        Path(args.json).write_text(to_json(res))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
