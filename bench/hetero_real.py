"""Real heterogeneity: this host's GPU and its CPU cores as workers of one job, balanced
by measured step times (needs CUDA; elsewhere it exits 0 saying why).

  PYTHONPATH=. python bench/hetero_real.py [--quick] [--json PATH] [--png PATH]

One `hetrain launch` (mode ps, 2 CPU summation servers) of this file as the worker on
a cluster of one GPU worker (`cuda: true`, `threads: --gpu-threads`) and `--cpu-workers`
CPU workers with `threads: --threads` each (the launcher pins each to cores of its own).
All phases run in that one launch, on an MLP (256 inputs, 3 hidden layers of a width from `--widths`, 10 classes;
synthetic data labelled by a fixed random teacher):

  calibrate   for every width, every worker times local steps (no communication) at a
              few batch sizes and fits fixed + per-sample seconds; one push_pull is
              timed. From these the bench predicts, for global batches 64·2^k, the
              GPU-only, CPU-only and mixed samples/s, and picks the (width, batch) where
              the CPU workers add most to the GPU while the predicted mixed/ideal stays
              >= 0.95 (see `choose`; `--global-batch` fixes the batch).
              A GPU is nearly flat in the batch until it is busy, and there a CPU adds
              little; communication grows with the model, not the batch: the table of
              predictions shows the trade-off on this host.
  gpu_local   the GPU worker trains alone at batch B, no communication (a one-GPU job).
  gpu         the job with only the GPU given samples (the CPU workers sit out with 0,
              and out of the gradient exchange: hetrain.api.members)
  cpu         the job with only the CPU workers given samples (balanced among them)
  mixed       GPU + CPU workers, balanced (BalancedLoader, measured shares)

gpu / cpu / mixed run through the same BalancedLoader and push_pull, so every part pays
the same communication; ideal = gpu_sps + cpu_sps. Each phase: warm-up steps (the fits
settle), then measured steps; samples/s = B x steps / wall time of the measured steps;
compute spread = median over measured steps of the slowest worker's compute / the
fastest's (workers with samples). Targets: mixed >= 0.85 of ideal (goal 0.95), spread
<= 1.10 (goal 1.05). `mixed_over_best_subset`: mixed over the better of gpu and cpu, the
subsets of the job's devices measured in the same run (the balancer prices each set's
exchange, so a set joins only where it helps): bar 0.95; `speedup_vs_gpu_local`: mixed
over gpu_local, bar 0.9 where the CPU workers do not help.

(b)+(c) HeterPS on real devices (`hetrain.pipeline.measure.measure_real`, the same
measurement as `bench/heterps.py --real`): the runtime's CTR model profiled on this
host's GPU and CPU workers, the exact plan for half the best reachable throughput run
for real beside the all-GPU and all-CPU plans (measured vs predicted samples/s and $ per
1M samples), and the pipeline's AUC beside one process on the same samples. On by
default; `--no-heterps` skips it.

`--cpu-dry-run` runs the same flow with the "GPU" worker on the CPU, at toy sizes, to
check the orchestration on a host without CUDA; its figures are not results.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from hetero_real_report import _png, _report  # noqa: E402
from pinned_pair import repo_env  # noqa: E402


# ---------------------------------------------------------------- the worker (launched) --

def predict(fixed, per, comm_s: float, max_batch: int) -> list[dict]:
    """For global batches 64·2^k: predicted samples/s of the GPU alone, the CPU workers
    alone and both balanced (in the job, so each pays one push_pull per step), from the
    calibration fits (fixed + per-sample seconds, worker 0 = the GPU)."""
    from hetrain.perf.steptime import solve_shares

    fixed, per = np.asarray(fixed), np.asarray(per)
    n, big, out = len(fixed), 10**12, []

    def level(bsz, caps):
        sizes = solve_shares(bsz, fixed, per, caps, 0)
        return float((fixed + per * sizes)[sizes > 0].max())

    b = 64
    while b <= max_batch:
        t_mix = level(b, [big] * n)
        t_gpu = fixed[0] + per[0] * b
        t_cpu = level(b, [0] + [big] * (n - 1)) if n > 1 else float("inf")
        mixed, gpu, cpu = b / (t_mix + comm_s), b / (t_gpu + comm_s), b / (t_cpu + comm_s)
        out.append({"global_batch": b, "step_s": t_mix, "mixed_sps": mixed, "gpu_sps": gpu, "cpu_sps": cpu,
                    "efficiency": mixed / (gpu + cpu), "cpu_over_gpu": cpu / gpu})
        b *= 2
    return out


def choose(calib: dict, given: int, min_step_s: float, max_step_s: float) -> tuple[int, int, dict]:
    """The (width, global batch) to measure at, from the predictions of every calibrated
    width: where the CPU workers add most to the GPU (at least 30% wanted) while the
    predicted mixed/ideal stays >= 0.95; failing that, the best mixed/ideal >= 0.85 with
    the CPUs adding at least 30%; failing that, the best mixed/ideal x min(1, CPU/GPU / 0.3). Only batches
    whose balanced step computes for min..max_step_s count. `given` fixes the batch (the
    width is still chosen). Returns (width, batch, its prediction)."""
    cands = []
    for width, c in calib.items():
        for p in c["candidates"]:
            if given and p is not min(c["candidates"], key=lambda q: abs(q["global_batch"] - given)):
                continue
            if given or min_step_s <= p["step_s"] <= max_step_s:
                cands.append((width, p))
    if not cands:
        cands = [(w, p) for w, c in calib.items() for p in c["candidates"]]
    eff = lambda x: x[1]["efficiency"]  # noqa: E731
    cpu = lambda x: x[1]["cpu_over_gpu"]  # noqa: E731
    for pool, key in (([x for x in cands if eff(x) >= 0.95 and cpu(x) >= 0.3], cpu),
                      ([x for x in cands if eff(x) >= 0.85 and cpu(x) >= 0.3], eff),
                      (cands, lambda x: eff(x) * min(1.0, cpu(x) / 0.3))):
        if pool:
            width, best = max(pool, key=key)
            break
    batch = (int(given) // 64 * 64 or 64) if given else int(best["global_batch"])
    return int(width), batch, best


def _mlp(width: int, inputs: int = 256, classes: int = 10, depth: int = 3):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layers, d = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, classes))


def _data(n: int, inputs: int = 256, classes: int = 10):
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, inputs, generator=g)
    teacher = torch.randn(inputs, classes, generator=g)
    return x, (x @ teacher).argmax(1)


def worker(a) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import hetrain
    from hetrain.runtime.memory import describe_device, synchronize
    from hetrain.perf.stepfit import StepTimeModel

    ctx = hetrain.init()
    rank, n = hetrain.rank(), hetrain.size()
    device = hetrain.device()  # cuda:0 on gpu0; the CPU workers are pinned to their own cores (`threads:`)
    group = ctx.worker_group

    def gather(values) -> np.ndarray:
        t = torch.tensor(values, dtype=torch.float64)
        out = [torch.zeros_like(t) for _ in range(n)]
        dist.all_gather(out, t, group=group)
        return torch.stack(out).numpy()

    def build(width: int):
        model = _mlp(width)
        hetrain.broadcast_parameters(model.state_dict(), root_rank=0)
        model.to(device)
        opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9),
                                           named_parameters=model.named_parameters())
        return model, opt, torch.optim.SGD(model.parameters(), lr=a.lr)

    def local_step(model, local_opt, x, y) -> None:
        local_opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        local_opt.step()

    def timed_local(model, local_opt, b: int, reps: int) -> float:
        x, y = _data(b)
        x, y = x.to(device), y.to(device)
        local_step(model, local_opt, x, y)  # warm-up: kernels, allocator
        synchronize(device)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            local_step(model, local_opt, x, y)
            synchronize(device)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    # -- calibrate every candidate width: fixed + per-sample per worker (local, no
    #    communication) and one push_pull; predict every global batch
    calib = {}
    for width in a.widths:
        model, _opt, local_opt = build(width)
        fit = StepTimeModel(window=32, recent=3)
        for b in a.calib_batches:
            fit.add(b, timed_local(model, local_opt, b, a.calib_reps))
        fixed, per = fit.fit()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        named = [(nm, p.grad) for nm, p in model.named_parameters()]
        hetrain.engine().push_pull(named, weight=1)  # warm-up: layouts, connections
        comm = []
        for _ in range(3):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            hetrain.engine().push_pull(named, weight=1)
            synchronize(device)
            comm.append(time.perf_counter() - t0)
        rows = gather([fixed, per, float(np.median(comm))])
        comm_s = float(rows[:, 2].max())
        calib[width] = {"fixed_s": rows[:, 0].tolist(), "per_sample_s": rows[:, 1].tolist(),
                        "push_pull_s": comm_s, "candidates": predict(rows[:, 0], rows[:, 1], comm_s, a.max_batch)}
        del model, _opt, local_opt
    width, B, chosen = choose(calib, a.global_batch, a.min_step_s, a.max_step_s)
    model, opt, local_opt = build(width)
    x_all, y_all = _data(max(2 * B, 4096))
    out: dict = {"calibration": {**calib[width], "samples": a.calib_batches, "global_batch": B, "width": width,
                                 "predicted": chosen, "widths": {str(w): c for w, c in calib.items()}},
                 "workers": list(ctx.topology.worker_labels),
                 "threads": gather([float(torch.get_num_threads())])[:, 0].astype(int).tolist()}

    # -- gpu_local: the GPU worker alone, no communication
    if rank == 0:
        xb, yb = x_all[:B].to(device), y_all[:B].to(device)
        local_step(model, local_opt, xb, yb)
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            local_step(model, local_opt, xb, yb)
        synchronize(device)
        out["gpu_local_sps"] = B * a.steps / (time.perf_counter() - t0)
        del xb, yb
    dist.barrier(group=group)

    out.update(_phases(a, (x_all, y_all), B, n, model, opt, device, lambda: dist.barrier(group=group)))
    if rank == 0:
        out["gpu_name"] = describe_device(device)
        Path(a.out).write_text(json.dumps(out))
    hetrain.shutdown()
    return 0


def _phases(a, data, batch: int, n: int, model, opt, device, barrier) -> dict:
    """The three in-job phases, through the same BalancedLoader and push_pull: the GPU
    only (the CPU workers capped at 0 samples), the CPU workers only, and all balanced;
    `a.rounds` times in turn, each phase's samples/s the median of its rounds."""
    from hetrain.train.balance import BalanceConfig
    from hetrain.train.loader import BalancedLoader

    out: dict = {}
    phases = {"gpu": [batch] + [0] * (n - 1), "cpu": [0] + [batch] * (n - 1), "mixed": [batch] * n}
    sps: dict[str, list[float]] = {name: [] for name in phases}
    for r in range(a.rounds):  # the phases take turns, so a host whose load drifts slows them alike
        for k, (name, limit) in enumerate(phases.items()):
            loader = BalancedLoader(data, batch, optimizer=opt, device=device, model=model,
                                    max_samples=limit, config=BalanceConfig(window=a.window), seed=k + 3 * r)
            out[name] = _phase(a, loader, model, opt, batch, barrier)  # the last round's details
            sps[name].append(out[name]["sps"])
            if name == "mixed":
                out["devices"] = [d.label() for d in loader.balancer.devices]
    for name, v in sps.items():  # each phase's rate: the median over the rounds
        out[name].update(sps=float(np.median(v)), sps_rounds=v)
    return out


def _phase(a, loader, model, opt, batch: int, barrier) -> dict:
    """One in-job phase: `a.warmup + a.steps` steps through `loader`; samples/s after the
    warm-up from the wall clock between two barriers of the workers (at the end of the
    warm-up, and after the last step's exchange: this worker may sit out and run ahead of
    the ones that train by up to two of the balancer's exchanges, which come only every
    16-64 steps while one worker trains alone), the shares, compute spreads, fits and
    where a step goes."""
    import torch.nn.functional as F

    total = a.warmup + a.steps
    stamps, rows, trained = [], [], 0
    step = 0
    while step < total:
        for x, y in loader:
            opt.zero_grad()
            if len(x):
                F.cross_entropy(model(x), y).backward()
            opt.step()
            stamps.append(time.perf_counter())
            trained += int(step >= a.warmup and len(x) > 0 and not loader.copies)
            if loader.batches.last_rows is not None:  # a step's per-worker metrics, agreed by all
                rows.append(loader.batches.last_rows.copy())
            step += 1
            if step == a.warmup:
                barrier()
                t0 = time.perf_counter()
            if step >= total:
                break
    loader.finish()  # close the last step (measured and exchanged like the others)
    barrier()
    t1 = time.perf_counter()
    stamps = np.asarray(stamps)
    sp = np.asarray(loader.spreads[a.warmup:], dtype=float)
    return {"sps": batch * a.steps / (t1 - t0),
            "shares": [h.tolist() for h in loader.balancer.history],
            "spread_median": float(np.nanmedian(sp)) if np.isfinite(sp).any() else None,
            "spread_p90": float(np.nanpercentile(sp, 90)) if np.isfinite(sp).any() else None,
            "fits": loader.balancer.fits.tolist(),
            # this worker's median step where it trained in most measured steps; else (it sat
            # out and its loop ran ahead of the others') the mean step between the barriers
            "step_ms": (float(np.median(np.diff(stamps[a.warmup - 1:]))) if trained * 2 >= a.steps
                        else (t1 - t0) / a.steps) * 1e3,
            "step_ms_from": "median step" if trained * 2 >= a.steps else "mean step between barriers",
            **_breakdown(rows[a.warmup:])}


def _breakdown(rows: list) -> dict:
    """Median per worker of the loader's own step rows (`METRICS`): compute, exposed
    exchange and waiting for the others, in ms; where a step's time goes."""
    from hetrain.train.balanced_sampler import METRICS

    if not rows:
        return {}
    r = np.asarray(rows, dtype=float)  # steps x workers x metrics
    col = {k: i for i, k in enumerate(METRICS)}
    return {f"{k[:-2]}_ms": (np.median(r[:, :, col[k]], axis=0) * 1e3).round(3).tolist()
            for k in ("compute_s", "comm_s", "wait_s")}


# ------------------------------------------------------------------------ the driver --

def _cluster(cpu_workers: int, threads: int, gpu_threads: int, servers: int, dry_run: bool) -> dict:
    """One GPU worker, `cpu_workers` CPU workers pinned to `threads` cores each (the
    launcher's `threads:`), `servers` CPU summation machines. The dry run pins nothing."""
    pin = (lambda t: {}) if dry_run else (lambda t: {"threads": t})  # noqa: E731
    machines = [{"name": "gpu0", "role": "worker", "device": {"kind": "cuda", "cuda": not dry_run}, **pin(gpu_threads)}]
    machines += [{"name": f"cpu{i}", "role": "worker", "device": {"kind": "cpu"}, **pin(threads)}
                 for i in range(cpu_workers)]
    machines += [{"name": f"c{j}", "role": "cpu"} for j in range(servers)]
    return {"name": "gpu-host", "machines": machines}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--png", help="shares over time (default: next to --json, else hetero_real_shares.png)")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024],
                    help="MLP widths to calibrate; the bench measures the one where CPU workers matter most "
                         "while the predicted mixed/ideal stays high")
    ap.add_argument("--cpu-workers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="threads (own cores) per CPU worker")
    ap.add_argument("--gpu-threads", type=int, default=2, help="cores pinned to the GPU worker's process")
    ap.add_argument("--global-batch", type=int, default=0,
                    help="global batch (default: chosen from the calibration: CPU workers adding most to the GPU "
                         "while the predicted mixed/ideal stays >= 0.95)")
    ap.add_argument("--min-step-s", type=float, default=0.002, help="shortest balanced step to consider (seconds)")
    ap.add_argument("--max-step-s", type=float, default=3.0, help="longest balanced step to consider (seconds)")
    ap.add_argument("--max-batch", type=int, default=262144)
    ap.add_argument("--no-heterps", dest="heterps", action="store_false",
                    help="skip HeterPS on real devices (exact vs all-GPU vs all-CPU plans, AUC vs one process)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: run the flow with the GPU worker on the CPU at toy sizes (not results)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, help="times the three in-job phases run in turn, each phase's samples/s "
                    "the median (default 1; 5 in a CPU dry run, where the phases share the host's few cores and a "
                    "round's rates move with its load by 10-30%%)")
    # the balancer's window (BalanceConfig.window): its default, what a user's job runs with
    ap.add_argument("--window", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, default=0.01, help=argparse.SUPPRESS)
    ap.add_argument("--calib-batches", type=int, nargs="+", default=[256, 1024, 4096, 16384], help=argparse.SUPPRESS)
    ap.add_argument("--calib-reps", type=int, default=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)

    import torch

    out: dict = {}
    if not torch.cuda.is_available() and not a.cpu_dry_run:
        reason = "hetero_real: needs CUDA (torch.cuda.is_available() is False on this host); nothing measured"
        print(reason)
        if a.json:
            Path(a.json).write_text(json.dumps({"skipped": reason, **out}, indent=2))
        return 0
    if a.cpu_dry_run:
        a.widths, a.cpu_workers, a.threads = [64, 128], min(a.cpu_workers, 2), 1
        a.min_step_s, a.max_batch, a.calib_batches, a.calib_reps = 0.005, 1024, [16, 64, 256], 2
    # measured steps: a run long enough that the balancer's first probe (after 64 steps with
    # a worker out, then its measured retries: train/probe.py, train/set_times.py) weighs
    # in it as in a longer run, not as a tenth of it; on a shared host, enough steps
    # that the phases' medians are not its noise (steps are a few ms)
    steps = a.steps or (192 if a.cpu_dry_run else (64 if a.quick else 128))
    # warm-up: the fits settle, and the balancer prices the exchange (a set's first exchange is
    # not counted, the next 4 are: hetrain/train/exchange_price.py) and settles on a set,
    # the sets it tries measured (train/set_times.py)
    warmup = a.warmup or (48 if a.cpu_dry_run else (24 if a.quick else 32))
    rounds = a.rounds or (5 if a.cpu_dry_run else 1)
    with tempfile.TemporaryDirectory(prefix="hetero-real-") as d:
        tmp = Path(d)
        import yaml

        (tmp / "cluster.yaml").write_text(yaml.safe_dump(_cluster(a.cpu_workers, a.threads, a.gpu_threads, 2,
                                                                  a.cpu_dry_run)))
        res_path = tmp / "res.json"
        cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--quiet", "--cluster", str(tmp / "cluster.yaml"),
               "--mode", "ps", "--timeout", "300", "--run-dir", str(tmp / "run"), str(Path(__file__).resolve()),
               "--worker", "--out", str(res_path), "--widths", *map(str, a.widths), "--global-batch", str(a.global_batch), "--min-step-s",
               str(a.min_step_s), "--max-step-s", str(a.max_step_s), "--max-batch", str(a.max_batch),
               "--steps", str(steps), "--warmup", str(warmup), "--rounds", str(rounds),
               "--window", str(a.window), "--lr", str(a.lr), "--calib-reps", str(a.calib_reps),
               "--calib-batches", *map(str, a.calib_batches)]
        env = repo_env()  # the repository before the caller's PYTHONPATH
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-3000:])
            return proc.returncode
        res = json.loads(res_path.read_text())
    print(f"[launch: {time.perf_counter() - t0:.0f}s]")
    out["mixed"] = _report(res, a)
    out["phases"] = {k: res[k] for k in ("gpu", "cpu", "mixed")}
    out["calibration"] = res["calibration"]
    out["config"] = {"width": res["calibration"]["width"], "widths": a.widths, "cpu_workers": a.cpu_workers,
                     "threads": a.threads, "gpu_threads": a.gpu_threads, "steps": steps,
                     "warmup": warmup, "rounds": rounds, "devices": res.get("devices"), "gpu": res.get("gpu_name"),
                     "dry_run_on_cpu": a.cpu_dry_run, "host_cpus": os.cpu_count()}
    if a.cpu_dry_run:
        out["note"] = "CPU dry run: the 'GPU' worker ran on the CPU at toy sizes; these figures are not results"
        print(out["note"])
    if a.heterps:
        _heterps(out, a)
    png = Path(a.png) if a.png else (Path(a.json).with_name(Path(a.json).stem + "_shares.png") if a.json
                                     else Path("hetero_real_shares.png"))
    _png(png, res)
    print(f"shares over time: {png}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {a.json}")
    return 0


def _heterps(out: dict, a) -> None:
    """HeterPS on this host's real devices, through the runtime's own measurement."""
    from hetrain.pipeline.measure import measure_real, table

    res = measure_real(cpu_threads=a.threads, cpu_dry_run=a.cpu_dry_run,
                       **({"batch": 4096, "micro_batches": 8, "steps": 3, "repeats": 1} if a.cpu_dry_run else {}))
    print(table(res))
    if "skipped" in res:
        out["heterps"] = {"skipped": res["skipped"]}
        return
    exact = res.get("heterps", {})
    out["heterps"] = {"measured_sps": exact.get("measured_sps"), "predicted_sps": exact.get("predicted_sps"),
                      "error": exact.get("error"), "plans": {k: res[k] for k in ("heterps", "all_gpu", "all_cpu")
                                                              if k in res},
                      "target": res["target"], "profile_check": res["profile_check"], "host": res["host"]}
    if "auc" in res:
        out["auc"] = res["auc"]


if __name__ == "__main__":
    sys.exit(main())
