"""Projections of the published setups with the whole-job cost model (hetrain/perf/job.py).

Not measurements: the cost model evaluated on the parameters written below (and in
docs/architecture.md), to set beside the papers' figures.

BytePS at 256 GPUs: 32 worker machines of 8 V100 each (a machine sums its 8 GPUs locally
and moves M bytes through one NIC), 100 Gbit/s NICs, k CPU machines of the same NIC,
fp32 gradients, many partitions (pipelined), no framework overhead. Two models: VGG-16
(138M parameters, 553 MB of gradient; 100 ms of compute per step at 32 images per GPU)
and a communication-bound one (the same gradient, 20 ms of compute). Candidates: ring
all-reduce, PS on the k CPU machines, BytePS with them; overlap off.

HeterPS's cost reduction: the placement model (hetrain/perf/pipeline.py) as run by
bench/plan.py, read from bench/results/plan-quick.json.

    PYTHONPATH=$PWD python bench/plan_projection.py --json bench/results/plan_projection.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetrain.perf.job import Candidate, Fitted, JobCluster, JobModel, JobWorker, predict  # noqa: E402

N_MACHINES, GPUS = 32, 8
NIC = 100e9 / 8
GRAD = 138e6 * 4
BATCH_PER_GPU = 32
MODELS = {"VGG-16 (100 ms compute)": 0.100, "comm-bound (20 ms compute)": 0.020}
PAPER = {"byteps_over_allreduce": 0.84, "byteps_over_ps": 2.45, "heterps_cost_lower": 3.123}


def byteps_projection() -> list[dict]:
    rows = []
    batch = N_MACHINES * GPUS * BATCH_PER_GPU
    for name, compute in MODELS.items():
        per_sample = compute / (GPUS * BATCH_PER_GPU)  # a machine's 8 GPUs together
        workers = tuple(JobWorker(f"m{i}", per_sample, NIC) for i in range(N_MACHINES))
        model = JobModel(name, GRAD, 0.0)
        for k in (4, 8, 16, 32):
            cl = JobCluster(workers, (NIC,) * k, partition_bytes=1.0)  # many partitions: pushes and pulls pipelined
            t = {m: predict(Candidate(m, "equal", False, "fp32"), model, cl, batch, Fitted()).step_s
                 for m in ("allreduce", "ps", "byteps")}
            rows.append({"model": name, "n": N_MACHINES, "gpus": N_MACHINES * GPUS, "k": k,
                         "step_s": t, "byteps_over_allreduce": t["allreduce"] / t["byteps"] - 1,
                         "byteps_over_ps": t["ps"] / t["byteps"] - 1})
    return rows


def heterps_projection() -> list[dict]:
    path = ROOT / "bench/results/plan-quick.json"
    rows = []
    for h in json.loads(path.read_text())["headline"]:
        rows.append({"model": h["model"], "catalogue": h["catalogue"],
                     "cost_lower_vs_all_cpu": h["all_cpu_cost"] / h["best_cost"] - 1 if h["all_cpu_cost"] else None,
                     "cost_lower_vs_all_gpu": h["all_gpu_cost"] / h["best_cost"] - 1 if h["all_gpu_cost"] else None,
                     "throughput_x_vs_gpu": h["throughput_x_vs_gpu"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bp = byteps_projection()
    print(f"BytePS projection (paper: up to {PAPER['byteps_over_allreduce']:.0%} faster than all-reduce, "
          f"{PAPER['byteps_over_ps']:.0%} faster than PS, 256 GPUs)")
    print(f"{'model':28s}{'k':>4}{'all-reduce ms':>15}{'PS ms':>9}{'BytePS ms':>11}{'vs AR':>8}{'vs PS':>8}")
    for r in bp:
        t = r["step_s"]
        print(f"{r['model']:28s}{r['k']:>4}{t['allreduce'] * 1e3:>15.1f}{t['ps'] * 1e3:>9.1f}{t['byteps'] * 1e3:>11.1f}"
              f"{r['byteps_over_allreduce']:>+8.0%}{r['byteps_over_ps']:>+8.0%}")
    hp = heterps_projection()
    print(f"\nHeterPS projection (paper: {PAPER['heterps_cost_lower']:.1%} lower cost)")
    for r in hp:
        cpu = f"{r['cost_lower_vs_all_cpu']:.0%}" if r["cost_lower_vs_all_cpu"] is not None else "n/a"
        gpu = f"{r['cost_lower_vs_all_gpu']:.0%}" if r["cost_lower_vs_all_gpu"] is not None else "infeasible"
        print(f"  {r['model']:12s}{r['catalogue']:5s} cost lower than all-CPU {cpu:>6}, than all-GPU {gpu}")
    if args.json:
        Path(args.json).write_text(json.dumps({"byteps": bp, "heterps": hp, "paper": PAPER,
                                               "projection": True}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
