"""Measured vs predicted on this host's real devices (what `bench/heterps.py --real` runs;
`measure_real` is the function other benchmarks call).

1. Profile the runtime's CTR model on the real CPU (workers of N threads on cores of
   their own) and on the GPU (pipeline/hostprofile.py), at the run's micro-batch size.
2. A catalogue of this host: its GPU as a GPU type (count 1), CPU workers of N threads
   as a CPU type (as many as fit beside the GPU process and the shards), list prices.
3. Plan exactly (the exact planner) for a throughput target (default: half the best
   any plan reaches on this host), and the all-GPU and all-CPU plans for the same target.
4. Run each feasible plan on the real devices (`--devices` file: the GPU type on CUDA,
   the CPU type on pinned cores; no padding), `repeats` times; the measured samples/s
   (median) and $ per million samples beside the cost model's prediction.
5. AUC of the exact plan's trained model (its checkpoint) against one process trained
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
from ..plan.base import Problem, get_planner
from ..plan.exact import max_throughput
from ..plan.render import plan_to_dict
from .cli import run_plan
from .data import CTRData
from .hostprofile import HostDevices, host_catalogue, host_devices, link_bandwidth, real_profile, stage_loop_time
from .reference import assemble, evaluate_auc, train_single
from .spec import RunSpec

PLANS = (("heterps", "exact"), ("all_gpu", "gpu"), ("all_cpu", "cpu"))


def _dry_run_devices(cpu_threads: int) -> HostDevices:
    """Without CUDA: the GPU type runs on the CPU too (checks the flow, not the figures)."""
    return HostDevices("gpu", "CPU standing in for a GPU (dry run)", 16 * 2**30, f"cpu{cpu_threads}t", cpu_threads,
                       1, 8 * 2**30)


def measure_real(*, target: float | None = None, batch: int = 65536, micro_batches: int = 32, cpu_threads: int = 4,
                 steps: int = 6, warmup_steps: int = 2, repeats: int = 2, samples: float = 1e8,
                 gpu_price: float | None = None, work_dir: str | None = None, cpu_dry_run: bool = False,
                 timeout: float = 60.0, log: Callable[[str], None] = print) -> dict:
    """Profile, plan and run on this host's real CPU and GPU; returns the figures (see the
    module docstring). Without CUDA returns ``{"skipped": reason}`` (unless
    `cpu_dry_run`, which maps the GPU type to the CPU to check the flow)."""
    if not cpu_dry_run and not torch.cuda.is_available():
        return {"skipped": "needs CUDA: this host has no CUDA device (torch.cuda.is_available() is false)"}
    t_start = time.perf_counter()
    work = Path(work_dir or tempfile.mkdtemp(prefix="heterps-real-"))
    work.mkdir(parents=True, exist_ok=True)
    m = batch // micro_batches
    dev = _dry_run_devices(cpu_threads) if cpu_dry_run else host_devices(cpu_threads)
    log(f"profiling the runtime's CTR model at micro-batches of {m} on {dev.gpu_name} and on CPU workers of "
        f"{dev.cpu_threads} threads ...")
    profile = real_profile(dev, m, gpu_device="cpu" if cpu_dry_run else "cuda")
    gpu_dev = "cpu" if cpu_dry_run else "cuda"
    # the whole model as one in-process stage (no messages) beside the profile's sum
    check = {dev.cpu_type: stage_loop_time("cpu", m, dev.cpu_threads), dev.gpu_type: stage_loop_time(gpu_dev, m)}
    act = max(l.act_bytes for l in profile.layers[:-1])  # the largest cut's activations per sample
    bandwidth = link_bandwidth(int(act * m))
    catalogue = host_catalogue(dev, bandwidth, gpu_price)
    cat_path, prof_path, dev_path = work / "catalogue.yaml", work / "profile.json", work / "devices.yaml"
    cat_path.write_text(yaml.safe_dump(catalogue.to_file(), sort_keys=False))
    profile.save(prof_path)
    dev_path.write_text(yaml.safe_dump({"types": {dev.gpu_type: {"device": gpu_dev},
                                                  dev.cpu_type: {"device": "cpu", "threads": dev.cpu_threads}}}))
    w = profile.workload(catalogue)
    params = CostParams(batch_size=batch)
    problem = Problem(w, target or 1.0, params, samples)
    best, _ = max_throughput(problem)
    if target is None:
        target = 0.5 * best
    problem = problem.with_target(target)
    log(f"link (TCP loopback, {act * m / 1e6:.2f} MB messages): {bandwidth / 1e9:.2f} GB/s; best reachable "
        f"{best:,.0f} samples/s; target {target:,.0f} samples/s")
    out: dict = {"host": {"gpu": dev.gpu_name, "cpu_threads": dev.cpu_threads, "cpu_workers": dev.cpu_count,
                          "dry_run": cpu_dry_run},
                 "catalogue": catalogue.to_file(), "profile": profile.model_dump(mode="json"),
                 "profile_check": {t: {"profile_sum_s": float(sum(profile.measured[t])), "stage_loop_s": v}
                                   for t, v in check.items()},
                 "link_bytes_per_s": bandwidth, "target": target, "best_reachable_sps": best, "batch": batch,
                 "micro_batches": micro_batches, "steps": steps, "warmup_steps": warmup_steps, "repeats": repeats,
                 "work_dir": str(work)}
    runs_dir = {}
    for label, planner in PLANS:
        res = get_planner(planner).plan(problem)
        plan = plan_to_dict(problem, res, profile.model, catalogue.name)
        stages = [f"{s['layers'][0]}-{s['layers'][1] - 1}:{s['type']}x{s['instances']}" for s in plan["stages"]]
        if not res.feasible:
            out[label] = {"feasible": False, "reason": res.score.reason, "stages": stages}
            log(f"{label}: infeasible ({res.score.reason})")
            continue
        runs = []
        for rep in range(repeats):
            r = run_plan(plan, catalogue=str(cat_path), profile=str(prof_path), devices=str(dev_path),
                         run_dir=str(work / f"{label}-{rep}"), quiet=True, steps=steps, warmup_steps=warmup_steps,
                         micro_batches=micro_batches, timeout=timeout)
            if r["rc"] != 0:
                raise RuntimeError(f"the {label} plan's run {rep} failed; logs in {r['run_dir']}")
            runs.append(r)
            log(f"  {label} run {rep}: measured {r['measured_sps']:,.0f} samples/s, predicted "
                f"{r['predicted_sps']:,.0f}")
        runs_dir[label] = runs[0]["run_dir"]
        meas = statistics.median(r["measured_sps"] for r in runs)
        pred, hourly = runs[0]["predicted_sps"], runs[0]["price_per_hour"]
        out[label] = {
            "feasible": True, "stages": stages, "processes": runs[0]["processes"],
            "measured_sps": meas, "measured_runs": [r["measured_sps"] for r in runs], "predicted_sps": pred,
            "error": meas / pred - 1, "price_per_hour": hourly,
            "measured_cost_per_million": hourly / 3600.0 / meas * 1e6,
            "predicted_cost_per_million": hourly / 3600.0 / pred * 1e6,
            "cost_error": pred / meas - 1,  # $ per sample: measured vs predicted
        }
    if "heterps" in runs_dir:
        spec = RunSpec.load(Path(runs_dir["heterps"]) / "spec.json")
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
    lines = [f"HeterPS runtime on real devices: {res['host']['gpu']} + CPU workers of {res['host']['cpu_threads']} "
             f"threads; batch {res['batch']}, {res['micro_batches']} micro-batches, {res['steps']} steps "
             f"({res['warmup_steps']} warm-up), median of {res['repeats']}; target {res['target']:,.0f} samples/s",
             f"{'plan':<8} {'stages':<34} {'measured':>10} {'predicted':>10} {'error':>7} {'$/hour':>7} "
             f"{'$/1M meas':>9} {'$/1M pred':>9}"]
    for label, _ in PLANS:
        c = res.get(label)
        if c is None:
            continue
        if not c["feasible"]:
            lines.append(f"{label:<8} {' '.join(c['stages']):<34} infeasible: {c['reason']}")
            continue
        lines.append(f"{label:<8} {' '.join(c['stages']):<34} {c['measured_sps']:>10,.0f} {c['predicted_sps']:>10,.0f} "
                     f"{c['error'] * 100:>+6.1f}% {c['price_per_hour']:>7.2f} {c['measured_cost_per_million']:>9.4f} "
                     f"{c['predicted_cost_per_million']:>9.4f}")
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
