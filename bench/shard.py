"""Sharded data parallelism with uneven shards on an emulated cluster of uneven speeds
and uneven memory caps.

  python bench/shard.py [--quick] [--json PATH] [--gpu] [--cases uneven,even]

Each case is one `hetrain launch` of `bench/shard_worker.py` on 3 workers of this host;
inside it, one after another from the same initial model, every worker trains with:

  hetrain   `hetrain.shard` at the stage the planner (perf/shardmem.py) chose: the
            fastest whose predicted peak fits every worker's cap; batch shares by
            speed, spans by memory (what each cap leaves after what the worker holds
            whole at that stage and its activations);
  zero1     PyTorch's ZeroRedundancyOptimizer over DDP (stage 1), even shards, even batch;
  fsdp2     PyTorch's FSDP2 `fully_shard` (each Linear, then the root), even shards,
            even batch.

The systems take turns, 2 repeats (--quick; 5 otherwise) of 8 steps (16) each; a
system's samples/s is the global batch over its median step time after 2 warm-up
steps, the median over repeats. Every worker runs under its cap (`MemoryCap`: on a CPU the resident set's high-water
mark above the moment the cap started, just before the model is built; on a GPU the
allocator's per-process fraction and its peak). A baseline whose measured peak passes a
cap on any worker *does not fit* (the case says so: that device would have run out of
memory); the case's `baseline` is the fastest baseline that fits, else the fastest one,
flagged. Bars: hetrain_sps / baseline_sps >= 1.2 (uneven case) / >= 0.95 (even case),
hetrain's peak within the cap on every worker, predicted peak within 15 % of measured.

Honesty notes: the devices are the calibrated model of cluster/device.py (a step of b
samples costs b x cost / speed seconds, cost 0.1 s; the real forward and backward, including the
communication waited for inside them, count toward it, sleep makes up the rest), so
ratios are stable on a shared host; the optimizer step and the communication after
backward are real and unemulated. The workers' C heap hands large blocks back to the
kernel (MALLOC_MMAP_THRESHOLD_=64 KiB, `--heap system`), so the resident set follows
the live tensors. `--gpu`: worker 0 is the host's first CUDA device capped below the
model's replica, beside two CPU workers (hetrain only).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from pinned_pair import repo_env  # noqa: E402

from hetrain.perf.shardmem import ShardModel, ShardWorker, choose_plan  # noqa: E402

WORKER = ROOT / "bench" / "shard_worker.py"
MiB = 2**20
HEAP = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
BANDWIDTH = 2e8  # bytes/s the planner assumes for gloo on this host's loopback (shared, loaded)


def model_of(width: int, depth: int) -> ShardModel:
    units = tuple([width * width + width] * depth + [10 * width + 10])
    # activations kept for backward, per sample: each Linear's input and each ReLU's output
    act = 4.0 * (2 * depth * width + 10)
    return ShardModel(f"mlp{depth}x{width}", units, act_bytes_per_sample=act)


CASES = {
    # name: (speeds, caps in MiB, width, depth, global batch)
    "uneven": ([1.0, 1.0, 0.4], [150, 90, 45], 768, 8, 24),
    "even": ([1.0, 1.0, 1.0], [80, 80, 80], 768, 8, 24),
    # even, but too tight for ZeRO-1 (and for stage 2): stage 3 against FSDP2
    "even-tight": ([1.0, 1.0, 1.0], [42, 42, 42], 768, 8, 24),
}


def _launch(tmp: Path, tag: str, machines: list[dict], args: list[str], limit: int = 1500) -> list[dict]:
    cfile = tmp / f"{tag}.yaml"
    cfile.write_text(yaml.safe_dump({"name": tag, "machines": machines}))
    out = tmp / f"{tag}.json"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--quiet", "--cluster", str(cfile), "--mode", "allreduce",
           "--heap", "system", "--run-dir", str(tmp / f"run-{tag}"), str(WORKER), *args, "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=repo_env(**HEAP))
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  [{tag}: {time.perf_counter() - t0:.0f}s]", flush=True)
    return json.loads(out.read_text())


def _sps(times: list[float], gb: int, warm: int) -> float:
    """Samples/s at the median step time after `warm` steps (robust to a load spike)."""
    steps = np.diff(np.asarray(times))[warm:]
    return float(gb / np.median(steps))


def run_case(tmp: Path, name: str, speeds, caps_mib, width, depth, gb, steps, cost, repeats: int,
             gpu=False) -> dict:
    caps = [c * MiB for c in caps_mib]
    model = model_of(width, depth)
    workers = [ShardWorker(f"w{i}", caps[i], cost / s, BANDWIDTH, builds_elsewhere=gpu and i == 0)
               for i, s in enumerate(speeds)]
    plan = choose_plan(model, workers, gb, stages=(1, 2, 3))
    machines = []
    for i, (s, c) in enumerate(zip(speeds, caps)):
        dev = {"speed": s, "memory": c}
        if gpu and i == 0:
            dev.update(kind="gpu", cuda=True)
        machines.append({"name": f"w{i}", "role": "worker", "device": dev})
    systems = "hetrain" if gpu else "hetrain,zero1,fsdp2"
    args = ["--systems", systems, "--stage", str(plan.stage), "--width", str(width), "--depth", str(depth),
            "--global-batch", str(gb), "--batch", ",".join(map(str, plan.batch)),
            "--weights", ",".join(f"{w:.6g}" for w in plan.weights), "--steps", str(steps), "--cost", str(cost),
            "--threads", str(4 if gpu else 1), "--repeats", str(repeats)]
    per_worker = _launch(tmp, name, machines, args)
    warm = 2
    res = {}
    for system in systems.split(","):
        reps = [w["results"][system] for w in per_worker]  # per worker: its repeats
        peaks = [max(r["peak_bytes"] for r in rr) for rr in reps]
        sps = [_sps(r["times"], gb, warm) for r in reps[0]]
        res[system] = {"sps": float(np.median(sps)), "sps_repeats": sps, "peak_bytes": peaks,
                       "fits": all(p <= c for p, c in zip(peaks, caps)),
                       "batch": [rr[0]["batch"] for rr in reps]}
    h = res["hetrain"]
    out = {"case": name, "speeds": speeds, "caps_bytes": caps, "state_bytes": model.state_bytes,
           "state_over_min_cap": model.state_bytes / min(caps),
           "ideal_ratio": sum(speeds) / (len(speeds) * min(speeds)), "stage": plan.stage, "plan_why": plan.why,
           "batch": list(plan.batch), "shares": [round(s, 4) for s in plan.shares],
           "hetrain_sps": h["sps"], "peak_bytes": h["peak_bytes"], "within_cap": h["fits"],
           "predicted_peak_bytes": list(plan.peak),
           "predicted_error": max(abs(p - m) / max(m, 1.0) for p, m in zip(plan.peak, h["peak_bytes"])),
           "systems": res}
    baselines = {k: v for k, v in res.items() if k != "hetrain"}
    if baselines:
        fitting = {k: v for k, v in baselines.items() if v["fits"]}
        pool = fitting or baselines
        best = max(pool, key=lambda k: pool[k]["sps"])
        out.update(baseline=best, baseline_sps=pool[best]["sps"], baseline_fits=bool(fitting),
                   ratio=h["sps"] / pool[best]["sps"],
                   # against the fastest baseline even where it passed a cap (a device with more memory)
                   ratio_vs_fastest_any=h["sps"] / max(v["sps"] for v in baselines.values()),
                   not_fitting={k: f"peak {max(v['peak_bytes']) / MiB:.1f} MiB on "
                                   f"w{int(np.argmax(np.array(v['peak_bytes']) - np.array(caps)))} over its cap"
                                for k, v in baselines.items() if not v["fits"]})
    else:
        out.update(baseline=None, baseline_sps=None, ratio=None)
    return out


def _table(results: list[dict]) -> None:
    print(f"\n{'case':8} {'stage':>5} {'state/min cap':>13} {'hetrain sps':>11} {'baseline':>9} {'base sps':>9} "
          f"{'ratio':>6} {'peak MiB (cap)':>32} {'pred err':>8}")
    for r in results:
        peaks = " ".join(f"{p / MiB:.0f}({c / MiB:.0f})" for p, c in zip(r["peak_bytes"], r["caps_bytes"]))
        base_sps = f"{r['baseline_sps']:.1f}" if r.get("baseline_sps") else "-"
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") else "-"
        print(f"{r['case']:8} {r['stage']:>5} {r['state_over_min_cap']:>13.2f} {r['hetrain_sps']:>11.1f} "
              f"{str(r['baseline']):>9} {base_sps:>9} {ratio:>6} {peaks:>32} {r['predicted_error']:>8.1%}")
        if r.get("ratio_vs_fastest_any"):
            print(f"    against the fastest baseline, fitting or not: {r['ratio_vs_fastest_any']:.2f}")
        for k, why in r.get("not_fitting", {}).items():
            print(f"    {k} does not fit: {why}")
        print(f"    planner: {r['plan_why']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps (a few minutes on a loaded 2-core host)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--cases", default="uneven,even,even-tight")
    ap.add_argument("--gpu", action="store_true", help="the GPU case only: a capped CUDA worker beside 2 CPU workers")
    a = ap.parse_args()
    steps, cost, repeats = (8, 0.1, 2) if a.quick else (16, 0.1, 5)
    results = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if a.gpu:
            # the replica (4 B/param) of a 16x1024 stack is 64.1 MiB; the GPU gets 56 MiB
            results.append(run_case(tmp, "gpu", [1.0, 0.25, 0.25], [56, 1024, 1024], 1024, 16, 96, steps,
                                    0.005, 1, gpu=True))
        else:
            for name in a.cases.split(","):
                speeds, caps, width, depth, gb = CASES[name]
                results.append(run_case(tmp, name, speeds, caps, width, depth, gb, steps, cost, repeats))
    _table(results)
    bars = []
    for r in results:
        need = 0.95 if r["case"].startswith("even") else 1.2
        bars.append({"case": r["case"], "ratio_ok": r["ratio"] is None or r["ratio"] >= need,
                     "within_cap": r["within_cap"], "prediction_ok": r["predicted_error"] <= 0.15,
                     "state_over_min_cap_ok": r["state_over_min_cap"] >= 1.5 or r["case"] == "even",
                     **({"replica_over_gpu_cap": 4 * r["state_bytes"] / 16 / r["caps_bytes"][0]}
                        if r["case"] == "gpu" else {})})
    print("bars:", json.dumps(bars))
    if a.json:
        Path(a.json).write_text(json.dumps({"cases": results, "bars": bars}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
