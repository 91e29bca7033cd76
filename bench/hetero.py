"""H-PS benchmarks on an emulated heterogeneous cluster.

  python bench/hetero.py [--quick] [--json PATH]

Five measurements, each a real `hetrain launch` of `bench/hetero_worker.py` (`real`: of
`bench/real_worker.py`):

  straggler     speeds {1, 1, 0.5, 0.25}, same model (digits MLP) and global batch:
                samples/s and time to a test accuracy of hetrain (measured balancing,
                sync) vs equal shares with PyTorch DDP on the same cluster.
                Ideal ratio Σs / (n · min s) = 2.75.
  interference  one worker drops from speed 1.0 to 0.25 (and back) several times
                mid-run: steps until its share has adapted, samples/s before and after.
  overlap       2 workers + 1 server on tc-shaped links (network namespaces, 200 Mbit):
                step time with and without overlap, beside compute-only and
                communication-only times.
  quant         bytes per step and final test accuracy for fp32, fp16, int8, int4.
  real          real compute, no cost model and no sleeps (bench/real_worker.py,
                bench/hetero_cases.py): an MLP, a CNN and a small transformer on 2
                workers with a core each, overlap on for hetrain and PyTorch DDP: even
                work (hetrain equal shares / DDP), uneven work (a worker slowed by extra
                forward passes: hetrain's unequal batches and accumulation counts vs DDP
                vs the ideal from the measured per-worker speeds), accuracy after the
                same samples vs one process, time to a test accuracy; 3 workers sharing
                the host's cores beside (full run). The host's load average is recorded.

Honesty notes, printed with the results: straggler and interference use a calibrated
device model (b samples cost b × c / speed seconds, sleep fills in after the real
compute) so their ratios are stable on a shared host; `real` does not, and says under
what load it ran; repeats run
inside one launch (fresh model each), medians reported; quant accuracy uses real
compute and equal shares so codecs are the only difference between runs.
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
from pinned_pair import repo_env  # noqa: E402
WORKER = ROOT / "bench" / "hetero_worker.py"
REAL_WORKER = ROOT / "bench" / "real_worker.py"
SPEEDS = [1.0, 1.0, 0.5, 0.25]


def _cluster(workers, cpus=1, bandwidth=None, netns=False, name="bench"):
    machines = []
    for i, w in enumerate(workers):
        m = {"name": f"w{i}", "role": "worker", "device": w}
        if bandwidth:
            m["bandwidth"] = bandwidth
        machines.append(m)
    for j in range(cpus):
        m = {"name": f"c{j}", "role": "cpu"}
        if bandwidth:
            m["bandwidth"] = bandwidth
        machines.append(m)
    spec = {"name": name, "machines": machines}
    if netns:
        spec["network"] = {"emulate": "netns"}
    return spec


def _launch(tmp: Path, tag: str, cluster: dict, mode: str, worker_args: list[str], flags=(), limit=900,
            worker: Path = WORKER) -> dict:
    cfile = tmp / f"{tag}.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    out = tmp / f"{tag}.json"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--quiet", "--cluster", str(cfile), "--mode", mode,
           "--run-dir", str(tmp / f"run-{tag}"), *flags, str(worker), *worker_args, "--out", str(out)]
    env = repo_env()  # the repository before the caller's PYTHONPATH
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  [{tag}: {time.perf_counter() - t0:.0f}s]", flush=True)
    return json.loads(out.read_text())


def _steady_sps(run: dict, gb: int, warm: int) -> float:
    t = np.asarray(run["times"])
    if len(t) <= warm + 1:
        return gb * len(t) / t[-1]
    return gb * (len(t) - 1 - warm) / (t[-1] - t[warm])


def _time_to(run: dict, target: float) -> float | None:
    for _step, t, acc in run["accs"]:
        if acc >= target:
            return t
    return None


def straggler(tmp, q) -> dict:
    gb, cost, target = 256, 0.005, (0.85 if q else 0.9)
    reps = 3 if q else 5
    args = ["train", "--global-batch", str(gb), "--cost", str(cost), "--target-acc", str(target),
            "--max-steps", "150", "--eval-every", "5", "--repeats", str(reps), "--lr", "0.1"]
    cl = _cluster([{"speed": s} for s in SPEEDS])
    hps = _launch(tmp, "straggler-hetrain", cl, "ps", args + ["--balance", "measured"])
    ddp = _launch(tmp, "straggler-ddp", cl, "allreduce", args + ["--balance", "equal", "--ddp"])
    warm = 4
    sps_h = [_steady_sps(r, gb, warm) for r in hps["runs"]]
    sps_d = [_steady_sps(r, gb, warm) for r in ddp["runs"]]
    tt_h = [_time_to(r, target) for r in hps["runs"]]
    tt_d = [_time_to(r, target) for r in ddp["runs"]]
    ideal = sum(SPEEDS) / (len(SPEEDS) * min(SPEEDS))
    ratio = float(np.median(sps_h) / np.median(sps_d))
    med = lambda xs: float(np.median([x for x in xs if x is not None])) if any(x is not None for x in xs) else None  # noqa: E731
    theory_h = gb * cost / sum(SPEEDS)
    theory_d = gb / len(SPEEDS) * cost / min(SPEEDS)
    return {"ratio": ratio, "ideal": ideal, "ratio_over_ideal": ratio / ideal,
            "samples_per_s": {"hetrain": float(np.median(sps_h)), "ddp": float(np.median(sps_d))},
            "samples_per_s_repeats": {"hetrain": sps_h, "ddp": sps_d},
            "time_to_acc_s": {"hetrain": med(tt_h), "ddp": med(tt_d), "target": target},
            "theory_step_s": {"hetrain": theory_h, "ddp": theory_d},
            "final_shares": hps["runs"][0]["sizes"][-1], "global_batch": gb, "cost_per_sample_s": cost,
            "hetrain_mode": hps["mode"]}


def interference(tmp, q) -> dict:
    gb, cost = 128, 0.004
    period = 10
    changes = [{"at_step": period * k, "speed": 0.25 if k % 2 else 1.0} for k in range(1, 6)]
    workers = [{"speed": 1.0}, {"speed": 1.0, "speed_schedule": changes}, {"speed": 1.0}, {"speed": 1.0}]
    res = _launch(tmp, "interference", _cluster(workers), "ps",
                  ["train", "--global-batch", str(gb), "--cost", str(cost), "--max-steps", str(period * 6),
                   "--eval-every", "0", "--repeats", "1", "--balance", "measured"])
    run = res["runs"][0]
    sizes = np.asarray(run["sizes"])  # sizes used at each step
    t = np.concatenate([[0.0], np.asarray(run["times"])])
    slow_target = gb * 0.25 / 3.25
    adapts, before, after = [], [], []
    for k in range(1, 6, 2):  # slowdowns at steps 10, 30, 50
        start, end = period * k, period * (k + 1)
        ok = np.abs(sizes[start:end, 1] - slow_target) <= 0.1 * slow_target + 1
        adapted = next((j for j in range(len(ok)) if ok[j:].all()), None)
        adapts.append(adapted if adapted is not None else period)
        a = start + (adapted if adapted is not None else period - 1)
        before.append(gb * 5 / (t[start] - t[start - 5]))
        after.append(gb * (end - a) / (t[end] - t[a]) if end > a else float("nan"))
    return {"adapt_steps": int(np.median(adapts)), "adapt_steps_each": adapts,
            "samples_per_s_before": float(np.median(before)), "samples_per_s_after": float(np.nanmedian(after)),
            "ideal_after_over_before": 3.25 / 4.0, "slow_share_target": slow_target,
            "w1_sizes": sizes[:, 1].tolist()}


def overlap(tmp, q) -> dict:
    from hetrain.cluster.netns import netns_available

    why = netns_available()
    bw = "200mbit"
    cl = _cluster([{"speed": 1.0}, {"speed": 1.0}], bandwidth=bw, netns=why is None)
    res = _launch(tmp, "overlap", cl, "ps", ["overlap", "--repeats", "3", "--steps", "2" if q else "4"],
                  flags=("--overlap", "--partition-bytes", "65536"))
    m = {k: float(np.median(res[k])) for k in ("compute_s", "comm_s", "step_plain_s", "step_overlap_s")}
    bound = max(m["compute_s"], m["comm_s"])
    theory_comm = 2 * res["grad_bytes"] / (200e6 / 8)  # the server's NIC carries both workers' pushes
    return {"step_s": m["step_overlap_s"], "step_no_overlap_s": m["step_plain_s"], "compute_s": m["compute_s"],
            "comm_s": m["comm_s"], "ratio_to_max": m["step_overlap_s"] / bound,
            "theory_comm_s": theory_comm,
            "ratio_to_max_theory": m["step_overlap_s"] / max(m["compute_s"], theory_comm),
            "hidden_s_median": float(np.median(res["hidden_s"])),
            "links": f"netns tbf {bw}" if why is None else f"unshaped loopback ({why})", "grad_bytes": res["grad_bytes"]}


def quant(tmp, q) -> list[dict]:
    rows = []
    cl = _cluster([{"speed": 1.0}, {"speed": 1.0}])
    for codec in ("fp32", "fp16", "int8", "int4"):
        res = _launch(tmp, f"quant-{codec}", cl, "ps",
                      ["train", "--global-batch", "64", "--max-steps", "200", "--eval-every", "0", "--repeats", "3",
                       "--balance", "equal", "--lr", "0.05"], flags=("--codec", codec))
        accs = [r["final_acc"] for r in res["runs"]]
        rows.append({"codec": codec, "bytes_per_step": float(np.median([r["bytes_per_step"] for r in res["runs"]])),
                     "accuracy": float(np.median(accs)), "accuracy_repeats": accs})
    base = rows[0]
    for r in rows:
        r["bytes_ratio"] = r["bytes_per_step"] / base["bytes_per_step"]
        r["accuracy_drop_points"] = 100 * (base["accuracy"] - r["accuracy"])
    return rows


def real(tmp, q) -> dict:
    """Real compute with overlap on for hetrain and DDP (bench/hetero_cases.py)."""
    from hetero_cases import run_cases

    def launch(tag, cluster, args, flags=()):
        return _launch(tmp, tag, cluster, "allreduce", args, flags=flags, worker=REAL_WORKER, limit=1800)

    return run_cases(launch, tmp, q)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer repeats and steps, a lower accuracy target (about 10 min on a 2-core host)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", nargs="*", choices=["straggler", "interference", "overlap", "quant", "real"])
    a = ap.parse_args(argv)
    todo = a.only or ["straggler", "interference", "overlap", "quant", "real"]
    out: dict = {"notes": ["compute: calibrated device model (b x cost / speed s; sleep fills in) in straggler and "
                           "interference; real compute in quant and real",
                           "repeats run inside one launch, fresh model each; medians reported"]}
    with tempfile.TemporaryDirectory(prefix="hetero-bench-") as d:
        tmp = Path(d)
        if "straggler" in todo:
            print("straggler: speeds", SPEEDS, flush=True)
            out["straggler"] = straggler(tmp, a.quick)
        if "interference" in todo:
            print("interference: w1 1.0 -> 0.25 at steps 10, 30, 50", flush=True)
            r = interference(tmp, a.quick)
            out["adapt_steps"] = r.pop("adapt_steps")
            out["interference"] = r
        if "overlap" in todo:
            print("overlap: 2 workers + 1 server, shaped links", flush=True)
            out["overlap"] = overlap(tmp, a.quick)
        if "quant" in todo:
            print("quant: fp32, fp16, int8, int4", flush=True)
            out["quant"] = quant(tmp, a.quick)
        if "real" in todo:
            print("real: real compute, overlap on: hetrain vs DDP on even and uneven workers (MLP, CNN, "
                  "transformer)", flush=True)
            out["real"] = real(tmp, a.quick)
    _table(out)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {a.json}")
        if "real" in out:
            from hetero_cases import plot

            plot(out["real"], Path(a.json).with_suffix(".png"))
    return 0


def _table(out: dict) -> None:
    print()
    if "straggler" in out:
        s = out["straggler"]
        print("== straggler (speeds 1, 1, 0.5, 0.25) ==")
        print(f"{'system':<26}{'samples/s':>11}{'theory':>9}{'time to ' + str(s['time_to_acc_s']['target']):>14}")
        gb = s["global_batch"]
        for k, label in (("hetrain", "hetrain balanced (sync)"), ("ddp", "PyTorch DDP equal shares")):
            tt = s["time_to_acc_s"][k]
            print(f"{label:<26}{s['samples_per_s'][k]:>11.1f}{gb / s['theory_step_s'][k]:>9.1f}"
                  f"{(f'{tt:.2f}s' if tt else 'not reached'):>14}")
        print(f"ratio {s['ratio']:.2f} vs ideal {s['ideal']:.2f} ({100 * s['ratio_over_ideal']:.0f}% of ideal; "
              f"bar 85%, goal 95%); final shares {s['final_shares']}")
    if "adapt_steps" in out:
        r = out["interference"]
        print("== interference (w1: 1.0 -> 0.25) ==")
        print(f"adapted within {out['adapt_steps']} steps (each slowdown: {r['adapt_steps_each']}; bar 10, goal 5); "
              f"samples/s {r['samples_per_s_before']:.1f} before, {r['samples_per_s_after']:.1f} after "
              f"(ideal after/before {r['ideal_after_over_before']:.3f}, measured "
              f"{r['samples_per_s_after'] / r['samples_per_s_before']:.3f})")
    if "overlap" in out:
        o = out["overlap"]
        print(f"== overlap ({o['links']}, {o['grad_bytes'] / 1e6:.1f} MB of gradients) ==")
        print(f"compute only {o['compute_s']:.3f}s | comm only {o['comm_s']:.3f}s (theory {o['theory_comm_s']:.3f}s) | "
              f"step without overlap {o['step_no_overlap_s']:.3f}s | with overlap {o['step_s']:.3f}s")
        print(f"overlapped / max(compute, comm) = {o['ratio_to_max']:.2f} (bar 1.2, goal 1.05); against the "
              f"theoretical comm time {o['ratio_to_max_theory']:.2f}; hidden per step {o['hidden_s_median']:.3f}s")
    if "quant" in out:
        print("== quantization (digits, 2 workers, equal shares, error feedback) ==")
        print(f"{'codec':<7}{'bytes/step':>12}{'x fp32':>8}{'accuracy':>10}{'drop pts':>10}")
        for r in out["quant"]:
            print(f"{r['codec']:<7}{r['bytes_per_step']:>12.0f}{r['bytes_ratio']:>8.3f}{r['accuracy']:>10.4f}"
                  f"{r['accuracy_drop_points']:>10.2f}")
    if "real" in out:
        from hetero_cases import table

        print("\n".join(table(out["real"])))
    for n in out.get("notes", []):
        print("note:", n)


if __name__ == "__main__":
    sys.exit(main())
