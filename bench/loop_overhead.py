"""What hetrain's training loop costs per step over a plain PyTorch loop, on one worker
that trains alone inside a job (the others sit out), side by side in one run.

  PYTHONPATH=. python bench/loop_overhead.py [--quick] [--json PATH]

One `hetrain launch` (mode `--mode`, default allreduce) of this file on `--workers` CPU
workers. Worker 0 trains a small MLP (256 inputs, 3 hidden layers of `--width`, 10
classes; SGD with momentum) at each global batch of `--batches`, two ways, taking turns
`--rounds` times so that a host whose load drifts slows both alike:

  plain     a plain loop in worker 0's process: a random permutation cut into batches
            (`index_select` on the tensors, as BalancedLoader does: faster than x[idx]),
            zero_grad, forward, backward, step. No hetrain.
  hetrain   the normal hetrain path, as `bench/hetero_real.py`'s `gpu` phase runs it:
            `BalancedLoader` with `max_samples=[B, 0, ...]` (the other workers sit out
            with share 0 and leave the gradient exchange: hetrain/api/members.py) and a
            `DistributedOptimizer`; every worker runs the loop, the others on empty batches.
  by speed  then, in rounds of their own beside the plain loop again, the same without
            caps: the other workers emulate devices `--slow-ms` per sample slower (a sleep
            after backward), so the balancer leaves them out by speed, as `hetero_real`'s
            `mixed` phase does where the CPU workers do not help (probes off: the figure is
            the loop's, not the probes' slow steps). `--no-by-speed` skips it.

Each round: warm-up steps (`--warmup` in the first round, 5 after), then `--steps`
timed on worker 0 (per-step time = elapsed / steps). Reported per batch: us/step of each
(medians over rounds), overhead us/step, and `ratio` = plain step / hetrain step (the
samples/s of hetrain over the plain loop's), the median of the rounds' ratios, and
`ratio_best`, each one's fastest round over the other's (the rounds least disturbed by
other processes); and each
process's CPU time per step, with `cpu_ratio` = plain's CPU time over the trainer's (on a
host whose cores other processes share, wall time moves with their load; CPU time much
less). A last, untimed pass of hetrain steps runs under
cProfile on worker 0 and on worker 1 (sitting out): where hetrain's per-step time goes,
per function and per area (`profile` and `profile_sitting_out` in the JSON, and the plain
loop's under the same profiler, `profile_plain`, for the difference; microseconds
per step, own time; and the hetrain functions' cumulative time). Each worker's CPU time
per step over the timed hetrain steps is reported too: on a host with fewer cores than
processes, the workers sitting out take CPU from the one that trains.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from hetero_real import _data, _mlp  # noqa: E402  (the same model and data as the heterogeneity bench)
from pinned_pair import repo_env  # noqa: E402

# where a function's own time is counted (first match of its file path)
AREAS = (("hetrain/train/", "hetrain.train (loader, balancer)"), ("hetrain/api/", "hetrain.api (optimizer, members)"),
         ("hetrain/comm/", "hetrain.comm (engine)"), ("hetrain/perf/", "hetrain.perf (fits, plans)"),
         ("hetrain/", "hetrain (other)"), ("torch/distributed", "torch.distributed"),
         ("torch/optim", "torch.optim"), ("torch/autograd", "torch autograd"), ("torch/nn", "torch.nn"),
         ("numpy", "numpy"), ("torch", "torch (other)"), ("builtins", "python builtins"))


# ---------------------------------------------------------------- the worker (launched) --
def _plain(model, opt, x, y, batch: int, steps: int, seed: int) -> tuple[float, float]:
    """`steps` plain steps; wall and CPU seconds per step."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    perm, at = torch.randperm(len(x), generator=g), 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        if at + batch > len(x):
            perm, at = torch.randperm(len(x), generator=g), 0
        idx = perm[at: at + batch]
        at += batch
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)  # as BalancedLoader indexes (the faster form)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def _hetrain(loader, model, opt, steps: int, slow_s: float = 0.0) -> tuple[float, float]:
    """`steps` steps through the loader (every worker); wall and CPU seconds per step on
    this worker (the CPU time of its process, its comm threads included). `slow_s`: an
    emulated slow device's extra seconds per sample (a sleep after backward)."""
    import torch.nn.functional as F

    done, t0, c0 = 0, time.perf_counter(), time.process_time()
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            if len(x):
                F.cross_entropy(model(x), y).backward()
                if slow_s:
                    time.sleep(slow_s * len(x))
            opt.step()
            done += 1
            if done >= steps:
                break
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def _area(path: str, fn: str) -> str:
    if path == "~":  # a built-in: by what it is
        path = ("torch/distributed" if "c10d" in fn else "torch/autograd" if "run_backward" in fn
                else "torch/nn" if "_nn." in fn else "numpy" if "numpy" in fn else "torch" if "torch" in fn
                else "builtins")
    return next((name for key, name in AREAS if key in path), "python (other)")


def _profile(prof: cProfile.Profile, steps: int, top: int = 40) -> dict:
    """Own time per function and per area, in microseconds per step."""
    st = pstats.Stats(prof)
    rows, areas, cum = [], {}, []
    for (path, line, fn), (_cc, calls, tt, ct, _callers) in st.stats.items():
        us = tt / steps * 1e6
        where = path.split("site-packages/")[-1].split(str(ROOT) + "/")[-1]
        rows.append((us, f"{where}:{line}({fn})", calls / steps))
        areas[_area(path, fn)] = areas.get(_area(path, fn), 0.0) + us
        if where.startswith("hetrain/"):
            cum.append((ct / steps * 1e6, f"{where}:{line}({fn})", calls / steps))
    rows.sort(reverse=True)
    cum.sort(reverse=True)
    return {"per_step_us_total": round(sum(r[0] for r in rows), 1),
            "areas_us": {k: round(v, 1) for k, v in sorted(areas.items(), key=lambda kv: -kv[1])},
            "top_functions": [{"us": round(us, 1), "calls_per_step": round(c, 2), "function": f}
                              for us, f, c in rows[:top]],
            "hetrain_cumulative": [{"us": round(us, 1), "calls_per_step": round(c, 2), "function": f}
                                   for us, f, c in cum[:top]]}


def worker(a) -> int:
    import copy

    import torch
    import torch.distributed as dist

    import hetrain
    from hetrain.train.balance import BalanceConfig
    from hetrain.train.loader import BalancedLoader

    ctx = hetrain.init()
    rank, n = hetrain.rank(), hetrain.size()
    x, y = _data(a.samples)
    out: dict = {"threads": torch.get_num_threads(), "batches": {}}
    for k, batch in enumerate(a.batches):
        model = _mlp(a.width)
        plain_model = copy.deepcopy(model)
        plain_opt = torch.optim.SGD(plain_model.parameters(), lr=a.lr, momentum=0.9)
        opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9),
                                           named_parameters=model.named_parameters())
        loader = BalancedLoader((x, y), batch, optimizer=opt, model=model, max_samples=[batch] + [0] * (n - 1),
                                config=BalanceConfig(window=8), seed=k)
        plain, plain_cpu, het, cpu = [], [], [], []
        for r in range(a.rounds):  # short rounds in turn: a host whose load drifts slows both alike
            if rank == 0:
                _plain(plain_model, plain_opt, x, y, batch, a.warmup if r == 0 else 5, seed=r)
                wall, busy = _plain(plain_model, plain_opt, x, y, batch, a.steps, seed=r)
                plain.append(wall)
                plain_cpu.append(busy)
            dist.barrier(group=ctx.worker_group)
            _hetrain(loader, model, opt, a.warmup if r == 0 else 5)
            wall, busy = _hetrain(loader, model, opt, a.steps)
            got = [torch.zeros(2, dtype=torch.float64) for _ in range(n)]
            dist.all_gather(got, torch.tensor([wall, busy], dtype=torch.float64), group=ctx.worker_group)
            het.append(wall)
            cpu.append([float(g[1]) for g in got])
        loader.finish()
        plain_prof = None
        if rank == 0:  # the plain loop under the same profiler: what hetrain adds is the difference
            plain_prof = cProfile.Profile()
            plain_prof.enable()
            _plain(plain_model, plain_opt, x, y, batch, a.steps, seed=a.rounds)
            plain_prof.disable()
        dist.barrier(group=ctx.worker_group)
        prof = cProfile.Profile() if rank <= 1 else None  # the trainer and one worker sitting out
        if prof is not None:
            prof.enable()
        _hetrain(loader, model, opt, a.steps)
        if prof is not None:
            prof.disable()
        loader.finish()
        if rank == 1:
            out["batches"][str(batch)] = {"profile_sitting_out": _profile(prof, a.steps)}
        if rank == 0:
            out["batches"][str(batch)] = {"plain_s": plain, "plain_cpu_s": plain_cpu, "hetrain_s": het,
                                          "cpu_s_per_worker": cpu, "profile": _profile(prof, a.steps),
                                          "profile_plain": _profile(plain_prof, a.steps),
                                          "shares": loader.balancer.sizes.tolist()}
        if a.by_speed:
            speed = _by_speed(a, ctx, rank, n, (x, y), batch, model, opt, (plain_model, plain_opt))
            if rank == 0:
                out["batches"][str(batch)]["by_speed"] = speed
    if rank <= 1:
        Path(a.out + ("" if rank == 0 else ".sitting-out")).write_text(json.dumps(out))
    hetrain.shutdown()
    return 0


def _by_speed(a, ctx, rank: int, n: int, data, batch: int, model, opt, plain) -> dict:
    """Rounds of the plain loop and of a job where the others sit out by speed: no caps, the
    other workers emulating devices `a.slow_ms` per sample slow (a sleep after backward),
    so the balancer leaves them out once measured; probes off (`probe_every=0`), so the
    figure is the loop's, not the probes' slow steps."""
    import torch
    import torch.distributed as dist

    from hetrain.train.balance import BalanceConfig
    from hetrain.train.loader import BalancedLoader

    loader = BalancedLoader(data, batch, optimizer=opt, model=model, config=BalanceConfig(window=8, probe_every=0),
                            seed=1000 + batch)
    slow = a.slow_ms / 1e3 if rank > 0 else 0.0
    plain_s, plain_cpu, het_s, cpu = [], [], [], []
    for r in range(a.rounds):
        if rank == 0:
            _plain(*plain, *data, batch, 5, seed=r)
            wall, busy = _plain(*plain, *data, batch, a.steps, seed=r)
            plain_s.append(wall)
            plain_cpu.append(busy)
        dist.barrier(group=ctx.worker_group)
        _hetrain(loader, model, opt, a.warmup if r == 0 else 5, slow)
        wall, busy = _hetrain(loader, model, opt, a.steps, slow)
        got = [torch.zeros(1, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(got, torch.tensor([busy], dtype=torch.float64), group=ctx.worker_group)
        het_s.append(wall)
        cpu.append([float(g[0]) for g in got])
    prof = cProfile.Profile() if rank == 0 else None
    if prof is not None:
        prof.enable()
    _hetrain(loader, model, opt, a.steps, slow)
    if prof is not None:
        prof.disable()
    loader.finish()
    return {"profile": _profile(prof, a.steps) if prof is not None else None,"plain_s": plain_s, "plain_cpu_s": plain_cpu, "hetrain_s": het_s, "cpu_s_per_worker": cpu,
            "shares": loader.balancer.sizes.tolist()}


# ------------------------------------------------------------------------ the driver --
def _table(res: dict, a) -> tuple[str, dict]:
    lines = [f"{'batch':>6}{'plain us/step':>15}{'hetrain us/step':>17}{'overhead us':>13}{'ratio':>8}{'best':>7}"
             f"{'plain CPU us':>14}{'CPU us: trainer, others':>26}{'CPU ratio':>11}", "-" * 117]
    summary = {}
    for batch, r in res["batches"].items():
        p, h = float(np.median(r["plain_s"])) * 1e6, float(np.median(r["hetrain_s"])) * 1e6
        ratio = float(np.median([pp / hh for pp, hh in zip(r["plain_s"], r["hetrain_s"])]))
        best = min(r["plain_s"]) / min(r["hetrain_s"])  # each at its least disturbed round
        cpu = (np.median(np.asarray(r["cpu_s_per_worker"]), axis=0) * 1e6).round(1).tolist()
        pc = float(np.median(r["plain_cpu_s"])) * 1e6
        cpu_ratio = float(np.median([pp / hh[0] for pp, hh in zip(r["plain_cpu_s"], r["cpu_s_per_worker"])]))
        summary[batch] = {"plain_us": round(p, 1), "hetrain_us": round(h, 1), "overhead_us": round(h - p, 1),
                          "ratio": round(ratio, 3), "ratio_best": round(best, 3),
                          "ratio_rounds": [round(pp / hh, 3) for pp, hh in zip(r["plain_s"], r["hetrain_s"])],
                          "plain_cpu_us": round(pc, 1), "cpu_us_per_worker": cpu, "cpu_ratio": round(cpu_ratio, 3)}
        others = ", ".join(f"{c:.0f}" for c in cpu[1:])
        lines.append(f"{batch:>6}{p:>15.0f}{h:>17.0f}{h - p:>13.0f}{ratio:>8.3f}{best:>7.3f}{pc:>14.0f}"
                     f"{cpu[0]:>12.0f}  {others:<12}{cpu_ratio:>11.3f}")
    speed = {b: r["by_speed"] for b, r in res["batches"].items() if "by_speed" in r}
    for batch, r in speed.items():
        p, h = float(np.median(r["plain_s"])) * 1e6, float(np.median(r["hetrain_s"])) * 1e6
        ratio = float(np.median([pp / hh for pp, hh in zip(r["plain_s"], r["hetrain_s"])]))
        best = min(r["plain_s"]) / min(r["hetrain_s"])
        pc = float(np.median(r["plain_cpu_s"])) * 1e6
        cpu = (np.median(np.asarray(r["cpu_s_per_worker"]), axis=0) * 1e6).round(1).tolist()
        cpu_ratio = float(np.median([pp / hh[0] for pp, hh in zip(r["plain_cpu_s"], r["cpu_s_per_worker"])]))
        summary[batch]["by_speed"] = {"plain_us": round(p, 1), "hetrain_us": round(h, 1), "ratio": round(ratio, 3),
                                      "ratio_best": round(best, 3), "plain_cpu_us": round(pc, 1),
                                      "cpu_us_per_worker": cpu, "cpu_ratio": round(cpu_ratio, 3), "shares": r["shares"]}
        others = ", ".join(f"{c:.0f}" for c in cpu[1:])
        lines.append(f"{batch:>6}{p:>15.0f}{h:>17.0f}{h - p:>13.0f}{ratio:>8.3f}{best:>7.3f}{pc:>14.0f}"
                     f"{cpu[0]:>12.0f}  {others:<12}{cpu_ratio:>11.3f}  alone by speed {r['shares']}")
    lines.append(f"ratio = plain step over hetrain step, both in wall time (hetrain's samples/s over the plain "
                 f"loop's), median over {a.rounds} rounds of plain then hetrain; best: the fastest round of each "
                 f"over the other's fastest; us/step: medians. CPU: each "
                 "process's CPU time per step (the workers sitting out run the loop on empty batches); CPU ratio "
                 "= plain's over the trainer's, the same per round (less moved by other processes' load)")
    for batch, r in res["batches"].items():
        prof = r["profile"]
        lines.append(f"\nbatch {batch}: where hetrain's step goes under cProfile (own time, us/step; profiling "
                     f"inflates it: {prof['per_step_us_total']:.0f} us/step in all)")
        plain = r["profile_plain"]["areas_us"]
        lines.append(f"  {'hetrain':>8}  {'plain':>8}  area (plain loop under the same profiler: "
                     f"{r['profile_plain']['per_step_us_total']:.0f} us/step)")
        lines += [f"  {us:>8.1f}  {plain.get(area, 0.0):>8.1f}  {area}" for area, us in prof["areas_us"].items()]
        lines += [f"    {f['us']:>8.1f}  x{f['calls_per_step']:<5} {f['function']}" for f in prof["top_functions"][:12]]
        lines.append(f"  a worker sitting out: {r['profile_sitting_out']['per_step_us_total']:.0f} us/step under "
                     "cProfile; its hetrain functions (cumulative, us/step):")
        lines += [f"    {f['us']:>8.1f}  x{f['calls_per_step']:<5} {f['function']}"
                  for f in r["profile_sitting_out"]["hetrain_cumulative"][:8]]
        lines.append("  the trainer's hetrain functions, time inside them (cumulative, us/step):")
        lines += [f"    {f['us']:>8.1f}  x{f['calls_per_step']:<5} {f['function']}"
                  for f in prof["hetrain_cumulative"][:14]]
    return "\n".join(lines), summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (a minute or two)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--mode", default="allreduce", help="the job's --mode (default allreduce)")
    ap.add_argument("--steps", type=int, help="timed steps per round (default 128; 64 with --quick: whole "
                    "periods of the metrics-only exchange, one every 64 steps, so each round pays its share)")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--rounds", type=int, help="rounds of plain / hetrain in turn (default 31; 11 with --quick)")
    ap.add_argument("--no-by-speed", dest="by_speed", action="store_false",
                    help="skip the rounds where the others sit out by speed (no caps, emulated slow devices)")
    ap.add_argument("--slow-ms", type=float, default=2.0,
                    help="the other workers' emulated extra milliseconds per sample in the by-speed rounds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=8192, help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, default=0.01, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.workers < 2:
        ap.error("--workers must be >= 2 (one trains, the others sit out)")
    if any(b < 1 for b in a.batches):
        ap.error(f"--batches must be >= 1 each, got {a.batches}")
    a.steps = a.steps or (64 if a.quick else 128)
    a.rounds = a.rounds or (11 if a.quick else 31)
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as d:
        import yaml

        tmp = Path(d)
        machines = [{"name": f"w{i}", "role": "worker", "device": {"kind": "cpu"}} for i in range(a.workers)]
        if a.mode in ("ps", "byteps"):
            machines.append({"name": "s0", "role": "cpu"})
        (tmp / "cluster.yaml").write_text(yaml.safe_dump({"name": "loop-overhead", "machines": machines}))
        res_path = tmp / "res.json"
        cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--quiet", "--cluster", str(tmp / "cluster.yaml"),
               "--mode", a.mode, "--timeout", "300", "--run-dir", str(tmp / "run"), str(Path(__file__).resolve()),
               "--worker", "--out", str(res_path), "--batches", *map(str, a.batches), "--width", str(a.width),
               "--steps", str(a.steps), "--warmup", str(a.warmup), "--rounds", str(a.rounds),
               "--samples", str(max(a.samples, 4 * max(a.batches))), "--lr", str(a.lr), "--slow-ms", str(a.slow_ms),
               *([] if a.by_speed else ["--no-by-speed"])]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=repo_env(), timeout=1800)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:])
            return proc.returncode
        res = json.loads(res_path.read_text())
        other = json.loads(Path(str(res_path) + ".sitting-out").read_text())
        for batch, r in other["batches"].items():
            res["batches"][batch].update(r)
    text, summary = _table(res, a)
    text += (f"\n[launch: {time.perf_counter() - t0:.0f}s; load average at start {load:.2f}, "
             f"{os.cpu_count()} CPUs; worker threads {res['threads']}]")
    print(text)
    if a.json:
        out = {"summary": summary, "raw": res, "config": {**{k: v for k, v in vars(a).items()
                                                              if k not in ("worker", "out", "json")},
                                                           "load_at_start": load, "host_cpus": os.cpu_count()}}
        Path(a.json).write_text(json.dumps(out, indent=2))
        Path(a.json).with_suffix(".txt").write_text(text + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
