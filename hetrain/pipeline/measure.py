"""Measured vs predicted on this host's real devices (what `bench/heterps.py --real` runs;
`measure_real` is the function other benchmarks call).

1. Profile the runtime's CTR model on the real CPU (workers of N threads on cores of
   their own) and on the GPU (pipeline/hostprofile.py) at a few micro-batch sizes, and
   keep the one whose best plan is fastest (pipeline/calibrate.py): the run uses it, so
   the GPU is profiled at the micro-batch it then runs, not one too small for it.
2. A catalogue of this host: its GPU as a GPU type (count 1), CPU workers of N threads
   as a CPU type (as many as fit beside the GPU process and the shards), list prices.
3. Calibration runs: each type's one-stage plan (all-GPU, all-CPU) at what it reaches
   alone; the ratio of predicted to measured throughput scales that type's layer times
   (what its processes pay beyond the profile).
4. Plan exactly on the calibrated profile for a target that needs the GPU where it helps
   (`calibrate.gpu_target`; `target` overrides), run it `repeats` times on the real
   devices (`--devices` file: the GPU type on CUDA, the CPU type on pinned cores; no
   padding) and set its measured samples/s (median) beside the prediction: the cost
   model on the calibrated profile plus the pipeline's fill and drain.
5. AUC of the checked plan's trained model (its checkpoint) against one process trained
   on the same samples.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

from ..perf.pipeline import CostParams
from ..plan.base import PlanResult, Problem
from ..plan.planners import get_planner
from ..plan.exact import max_throughput
from ..plan.render import plan_to_dict
from .calibrate import (choose_micro_batches, gpu_target, micro_batch_choices, scaled_profile, type_factor,
                        with_fill_drain)
from .cli import run_plan
from .data import CTRData
from .hostprofile import HostDevices, host_catalogue, host_devices, link_bandwidth, real_profile, stage_loop_time
from .workload import MODEL_NAME
from .reference import assemble, evaluate_auc, train_single
from .spec import RunSpec

PLANS = ("all_gpu", "all_cpu", "heterps")  # the calibration runs, then the checked plan


def _dry_run_devices(cpu_threads: int) -> HostDevices:
    """Without CUDA: the GPU type runs on the CPU too (checks the flow, not the figures)."""
    return HostDevices("gpu", "CPU standing in for a GPU (dry run)", 16 * 2**30, f"cpu{cpu_threads}t", cpu_threads,
                       1, 8 * 2**30)


def _profiles(dev: HostDevices, batch: int, counts: list[int], gpu_dev: str, log) -> dict[int, tuple]:
    """Per micro-batch count: (profile at batch / count, the host's catalogue with the link
    measured at that micro-batch's activations)."""
    out = {}
    for c in counts:
        m = batch // c
        log(f"profiling the runtime's CTR model at micro-batches of {m} on {dev.gpu_name} and on CPU workers of "
            f"{dev.cpu_threads} threads ...")
        profile = real_profile(dev, m, gpu_device=gpu_dev)
        act = max(l.act_bytes for l in profile.layers[:-1])  # the largest cut's activations per sample
        out[c] = (profile, host_catalogue(dev, link_bandwidth(int(act * m)), None))
    return out


def _run(label: str, problem: Problem, assignment, files: dict, work: Path, repeats: int, opts: dict, log) -> dict:
    """Run one placement `repeats` times on the real devices: its figures (measured median)."""
    res = PlanResult(label, problem.evaluate(assignment), 0.0)
    plan = plan_to_dict(problem, res, MODEL_NAME, files["catalogue_name"])
    stages = [f"{s['layers'][0]}-{s['layers'][1] - 1}:{s['type']}x{s['instances']}" for s in plan["stages"]]
    if not res.feasible:
        log(f"{label}: infeasible ({res.score.reason})")
        return {"feasible": False, "reason": res.score.reason, "stages": stages}
    runs = []
    for rep in range(repeats):
        r = run_plan(plan, catalogue=files["catalogue"], profile=files["profile"], devices=files["devices"],
                     run_dir=str(work / f"{label}-{rep}"), quiet=True, **opts)
        if r["rc"] != 0:
            raise RuntimeError(f"the {label} plan's run {rep} failed; logs in {r['run_dir']}")
        runs.append(r)
        log(f"  {label} run {rep}: measured {r['measured_sps']:,.0f} samples/s, predicted {r['predicted_sps']:,.0f} "
            "(steady state)")
    batch, mb = problem.params.batch_size, runs[0]["micro_batches"]
    steady, hourly = runs[0]["predicted_sps"], runs[0]["price_per_hour"]
    pred = with_fill_drain(steady, batch, res.score, batch // mb)
    meas = statistics.median(r["measured_sps"] for r in runs)
    return {"feasible": True, "stages": stages, "processes": runs[0]["processes"], "micro_batches": mb,
            "gpu_stage": any(s["type"] == files["gpu_type"] for s in plan["stages"]),
            "measured_sps": meas, "measured_runs": [r["measured_sps"] for r in runs], "predicted_sps": pred,
            "predicted_steady_sps": steady, "error": meas / pred - 1, "price_per_hour": hourly,
            "measured_cost_per_million": hourly / 3600.0 / meas * 1e6,
            "predicted_cost_per_million": hourly / 3600.0 / pred * 1e6, "cost_error": pred / meas - 1,
            "run_dir": runs[0]["run_dir"], "assignment": list(res.score.assignment)}


def measure_real(*, target: float | None = None, batch: int = 65536, micro_batches: int = 32, cpu_threads: int = 4,
                 steps: int = 6, warmup_steps: int = 2, repeats: int = 2, samples: float = 1e8,
                 gpu_price: float | None = None, work_dir: str | None = None, cpu_dry_run: bool = False,
                 timeout: float = 60.0, micro_batch_spread: tuple[int, ...] = (1, 4, 16),
                 log: Callable[[str], None] = print) -> dict:
    """Profile, calibrate, plan and run on this host's real CPU and GPU; returns the
    figures (see the module docstring). Without CUDA returns ``{"skipped": reason}``
    (unless `cpu_dry_run`, which maps the GPU type to the CPU to check the flow)."""
    if not cpu_dry_run and not torch.cuda.is_available():
        return {"skipped": "needs CUDA: this host has no CUDA device (torch.cuda.is_available() is false)"}
    t_start = time.perf_counter()
    work = Path(work_dir or tempfile.mkdtemp(prefix="heterps-real-"))
    work.mkdir(parents=True, exist_ok=True)
    dev = _dry_run_devices(cpu_threads) if cpu_dry_run else host_devices(cpu_threads)
    gpu_dev = "cpu" if cpu_dry_run else "cuda"
    # 1. the micro-batch the run uses: each candidate profiled on every type, the fastest kept
    by_count = _profiles(dev, batch, micro_batch_choices(batch, micro_batches, dev.cpu_count, micro_batch_spread), gpu_dev, log)
    count, reach = choose_micro_batches({c: p for c, (p, _) in by_count.items()}, by_count[next(iter(by_count))][1],
                                        batch)
    profile, catalogue = by_count[count]
    if gpu_price is not None:
        catalogue = host_catalogue(dev, float(catalogue.kinds[0].bandwidth), gpu_price)
    m = batch // count
    check = {dev.cpu_type: stage_loop_time("cpu", m, dev.cpu_threads), dev.gpu_type: stage_loop_time(gpu_dev, m)}
    cat_path, prof_path, dev_path = work / "catalogue.yaml", work / "profile.json", work / "devices.yaml"
    cat_path.write_text(yaml.safe_dump(catalogue.to_file(), sort_keys=False))
    profile.save(prof_path)
    dev_path.write_text(yaml.safe_dump({"types": {dev.gpu_type: {"device": gpu_dev},
                                                  dev.cpu_type: {"device": "cpu", "threads": dev.cpu_threads}}}))
    files = {"catalogue": str(cat_path), "profile": str(prof_path), "devices": str(dev_path),
             "catalogue_name": catalogue.name, "gpu_type": dev.gpu_type}
    opts = dict(steps=steps, warmup_steps=warmup_steps, micro_batches=count, timeout=timeout)
    params = CostParams(batch_size=batch)
    base = Problem(profile.workload(catalogue), 1.0, params, samples)
    log(f"micro-batches per step: {count} ({m:,} samples; best reachable by count: "
        + ", ".join(f"{c}: {v:,.0f}/s" for c, v in reach.items()) + ")")
    out: dict = {"host": {"gpu": dev.gpu_name, "cpu_threads": dev.cpu_threads, "cpu_workers": dev.cpu_count,
                          "dry_run": cpu_dry_run},
                 "micro_batch_choice": {str(c): v for c, v in reach.items()}, "micro_batches": count,
                 "profile_check": {t: {"profile_sum_s": float(sum(profile.measured[t])), "stage_loop_s": v}
                                   for t, v in check.items()},
                 "link_bytes_per_s": float(catalogue.kinds[0].bandwidth), "batch": batch, "steps": steps,
                 "warmup_steps": warmup_steps, "repeats": repeats, "work_dir": str(work)}
    # 2. calibration: each type's one-stage plan at what it reaches alone
    factors, single_best = {}, {}
    for label, planner, tname in (("all_gpu", "gpu", dev.gpu_type), ("all_cpu", "cpu", dev.cpu_type)):
        a = get_planner(planner).solve(base)[0]
        top = max_throughput(base, a)[0] if a is not None else 0.0
        if top <= 0:
            out[label] = {"feasible": False, "reason": f"no {tname} placement fits", "stages": []}
            continue
        out[label] = r = _run(label, base.with_target(0.95 * top), a, files, work, repeats, opts, log)
        factors[tname] = type_factor(r["predicted_steady_sps"], r["measured_sps"])
        single_best[tname] = top / factors[tname]
    calibrated = scaled_profile(profile, factors)
    calibrated.save(prof_path)
    out["profile"], out["calibrated_profile"] = profile.model_dump(mode="json"), calibrated.model_dump(mode="json")
    out["type_factors"] = factors
    # 3. the checked plan: exact, on the calibrated profile, at a target that needs the GPU where it helps
    problem = Problem(calibrated.workload(catalogue), 1.0, params, samples)
    best, _ = max_throughput(problem)
    target = target or gpu_target(best, max(single_best.values(), default=0.0))
    problem = problem.with_target(target)
    log(f"calibrated: time per sample x{', x'.join(f'{v:.2f} ({t})' for t, v in factors.items())}; best reachable "
        f"{best:,.0f} samples/s; target {target:,.0f} samples/s")
    res = get_planner("exact").plan(problem)
    if not res.feasible:
        out["heterps"] = {"feasible": False, "reason": res.score.reason, "stages": []}
    else:
        out["heterps"] = _run("heterps", problem, res.score.assignment, files, work, repeats, opts, log)
        single = [out[k].get("assignment") for k in ("all_gpu", "all_cpu") if out.get(k, {}).get("feasible")]
        out["heterps"]["same_as_calibration"] = list(res.score.assignment) in single
    out.update(target=target, best_reachable_sps=best, catalogue=catalogue.to_file())
    if out["heterps"].get("feasible"):
        spec = RunSpec.load(Path(out["heterps"]["run_dir"]) / "spec.json")
        log(f"AUC: one process on the same {spec.steps * spec.batch:,} samples ...")
        single = train_single(spec)
        out["auc"] = {"pipeline": evaluate_auc(assemble(spec, spec.steps), spec), "single": evaluate_auc(single, spec),
                      "ceiling": CTRData(spec.data).ceiling_auc, "samples": spec.steps * spec.batch}
    out["wall_s"] = time.perf_counter() - t_start
    return out


def table(res: dict) -> str:
    """The result as a table a person reads."""
    if "skipped" in res:
        return res["skipped"]
    if "target" not in res:
        return "no result (the run stopped before planning)"
    lines = [f"HeterPS runtime on real devices: {res['host']['gpu']} + CPU workers of {res['host']['cpu_threads']} "
             f"threads; batch {res['batch']}, {res['micro_batches']} micro-batches, {res['steps']} steps "
             f"({res['warmup_steps']} warm-up), median of {res['repeats']}; target {res['target']:,.0f} samples/s",
             f"{'plan':<8} {'stages':<34} {'measured':>10} {'predicted':>10} {'error':>7} {'$/hour':>7} "
             f"{'$/1M meas':>9} {'$/1M pred':>9}"]
    for label in PLANS:
        c = res.get(label)
        if c is None:
            continue
        if not c["feasible"]:
            lines.append(f"{label:<8} {' '.join(c['stages']):<34} infeasible: {c['reason']}")
            continue
        role = "calibration" if label != "heterps" else ("checked" if not c.get("same_as_calibration")
                                                         else "checked (a calibration plan: not independent)")
        lines.append(f"{label:<8} {' '.join(c['stages']):<34} {c['measured_sps']:>10,.0f} {c['predicted_sps']:>10,.0f} "
                     f"{c['error'] * 100:>+6.1f}% {c['price_per_hour']:>7.2f} {c['measured_cost_per_million']:>9.4f} "
                     f"{c['predicted_cost_per_million']:>9.4f}  {role}")
    if res.get("type_factors"):
        lines.append("calibration (measured time per sample over the profile's, one-stage runs): "
                     + ", ".join(f"{t} x{v:.2f}" for t, v in res["type_factors"].items())
                     + "; micro-batches chosen by best reachable: "
                     + ", ".join(f"{c}: {v:,.0f}/s" for c, v in res.get("micro_batch_choice", {}).items()))
    h = res.get("heterps", {})
    if h.get("feasible"):
        lines.append(f"checked plan: stage on the GPU: {'yes' if h['gpu_stage'] else 'no'}; predicted "
                     f"{h['predicted_steady_sps']:,.0f}/s steady, {h['predicted_sps']:,.0f}/s with fill and drain; "
                     f"error {h['error'] * 100:+.1f}% (bar: within 15%)")
    for t, c in res.get("profile_check", {}).items():
        lines.append(f"profile check, {t}: layers' sum {c['profile_sum_s'] * 1e6:.2f} us/sample, the whole model as one "
                     f"in-process stage {c['stage_loop_s'] * 1e6:.2f} us/sample")
    if "auc" in res:
        a = res["auc"]
        lines.append(f"AUC after {a['samples']:,} samples: pipeline {a['pipeline']:.4f}, one process {a['single']:.4f} "
                     f"(diff {a['pipeline'] - a['single']:+.4f}); ceiling {a['ceiling']:.4f}")
    return "\n".join(lines)


def to_json(res: dict) -> str:
    return json.dumps(res, indent=1, default=lambda x: float(x) if isinstance(x, np.floating) else str(x))
