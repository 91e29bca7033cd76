"""Real executor: runs a small workload of real training jobs on this host's emulated
GPU pool under a scheduling policy, calling the policy exactly as the simulator does.

Each job runs through hetrain's single launcher (`hetrain launch --mode allreduce -m
hetrain.sched.worker`) on an emulated cluster of as many worker machines as the job
has GPUs. To resize a job the executor sends SIGUSR1 to its launcher, which passes it
to the ranks; they agree on a step boundary, checkpoint atomically and exit with
EXIT_STOPPED (the launcher returns it too), and the job restarts at
its new size from the checkpoint. The executor measures every stop/restart (signal to
the first step at the new size, minus one step) and the cold start of each job, and
feeds the running mean back into the jobs' `restart_cost`, so the policy charges what
restarts really cost here.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..perf.jobs import RingCurve
from .cluster import GpuCluster, parse_cluster_spec
from .job import Alloc, Job, make_job
from .policies import check_allocation, get_policy
from .worker import EXIT_STOPPED


@dataclass
class RealJobSpec:
    name: str
    arrival: float
    steps: int
    compute_s: float          # emulated compute of one global batch on one device
    batch: int = 32
    seed: int = 0
    max_gpus: int = 2


def tiny_workload() -> list[RealJobSpec]:
    """Three short jobs (a few seconds each); at most 4 processes at once."""
    return [RealJobSpec("a", 0.0, 40, 0.40, seed=1), RealJobSpec("b", 2.0, 24, 0.30, seed=2),
            RealJobSpec("c", 4.0, 30, 0.40, seed=3)]


def _even_sizes_only(job: Job, batch: int) -> None:
    """World sizes must split the global batch evenly (e.g. no 3 ranks for batch 32)."""
    for g in range(1, job.rates.shape[1]):
        if batch % g:
            job.rates[:, g] = 0.0


def launch_job(job_dir: Path, world: int, worker_args: list[str], quiet: bool = True) -> subprocess.Popen:
    """Start one job of `world` ranks with `hetrain launch`; returns the launcher process."""
    import yaml

    cluster = {"name": f"job-{world}", "machines": [
        {"name": f"g{i}", "role": "worker", "device": {"kind": "emulated-gpu"}} for i in range(world)]}
    cfile = job_dir / f"cluster-{world}.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "allreduce",
           "--run-dir", str(job_dir / "run")] + (["--quiet"] if quiet else []) + \
          ["-m", "hetrain.sched.worker", "--job-dir", str(job_dir), *worker_args]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def model_bytes(dim: int = 16) -> float:
    return 4.0 * (dim * 64 + 64 + 64 + 1)


@dataclass
class _Run:
    spec: RealJobSpec
    job: Job
    dir: Path
    procs: list = field(default_factory=list)
    alloc: Alloc | None = None
    target: Alloc | None = None
    stopping_since: float | None = None
    launched_at: float | None = None
    launch_step: int = 0
    pending_cost: float | None = None   # stop duration, to add to the restart's start time
    first_launch: bool = True
    finish: float | None = None
    restarts: int = 0


def _progress(d: Path) -> int:
    try:
        return int((d / "progress").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def run_workload(specs: list[RealJobSpec], cluster: GpuCluster, policy: str, workdir: str | Path,
                 restart_cost: float = 3.0, poll_s: float = 0.05, timeout_s: float = 300.0,
                 log=print) -> dict:
    """Run the jobs for real; returns JCTs, restarts and the measured start/restart costs."""
    if len(cluster.types) != 1:
        raise UserError("the real executor emulates one GPU type; give --cluster like cpu:4")
    pol = get_policy(policy)
    gtype = cluster.types[0]
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    curve_for = lambda s: RingCurve({gtype: s.compute_s}, model_bytes=model_bytes(), bandwidth=3.1e9,  # noqa: E731
                                    max_g=s.max_gpus)
    runs: list[_Run] = []
    for i, s in enumerate(specs):
        if s.batch % 4:
            raise UserError(f"job {s.name}: batch {s.batch} must divide by every size up to 4")
        d = workdir / s.name
        d.mkdir(parents=True, exist_ok=True)
        for f in ("progress", "stats.jsonl"):
            (d / f).unlink(missing_ok=True)
        shutil.rmtree(d / "elastic", ignore_errors=True)  # the job's commits (hetrain.elastic.State)
        job = make_job(i, s.name, s.arrival, s.steps, curve_for(s), cluster, max_gpus=s.max_gpus,
                       restart_cost=restart_cost)
        _even_sizes_only(job, s.batch)
        runs.append(_Run(s, job, d))
    restart_costs: list[float] = []
    start_costs: list[float] = []
    t0 = time.time()
    alloc: dict[int, Alloc] = {}

    def launch(r: _Run, a: Alloc, now: float):
        r.procs = [launch_job(r.dir, a.n, ["--steps", str(r.spec.steps), "--batch", str(r.spec.batch),
                                           "--seed", str(r.spec.seed), "--compute-s", str(r.spec.compute_s)])]
        r.alloc, r.launched_at, r.launch_step = a, now, _progress(r.dir)
        if not r.first_launch:
            r.restarts += 1
        r.job.started = True

    active: list[_Run] = []
    arrived = set()
    replan = True
    try:
        while True:
            now = time.time() - t0
            if now > timeout_s:
                raise RuntimeError(f"workload did not finish in {timeout_s} s")
            for r in runs:
                if r.job.job_id not in arrived and r.spec.arrival <= now:
                    arrived.add(r.job.job_id)
                    active.append(r)
                    replan = True
            for r in list(active):
                # cost measurement: first step after a (re)launch
                if r.launched_at is not None and _progress(r.dir) > r.launch_step:
                    step_s = r.spec.compute_s / r.alloc.n
                    cost = max(0.0, (time.time() - t0) - r.launched_at - step_s)
                    if r.first_launch:
                        start_costs.append(cost)
                        r.first_launch = False
                    elif r.pending_cost is not None:
                        restart_costs.append(r.pending_cost + cost)
                    r.pending_cost = None
                    r.launched_at = None
                if r.procs and all(p.poll() is not None for p in r.procs):
                    codes = [p.returncode for p in r.procs]
                    errs = [p.stdout.read().decode()[-2000:] for p in r.procs]
                    r.procs = []
                    if all(c == 0 for c in codes):
                        r.finish = time.time() - t0
                        active.remove(r)
                        alloc.pop(r.job.job_id, None)
                        log(f"[{r.finish:6.1f}s] job {r.spec.name} finished (JCT {r.finish - r.spec.arrival:.1f}s)")
                        replan = True
                    elif all(c == EXIT_STOPPED for c in codes):
                        r.pending_cost = time.time() - t0 - r.stopping_since
                        r.stopping_since = None
                        r.alloc = None
                    else:
                        raise RuntimeError(f"job {r.spec.name} failed with exit codes {codes}: {errs}")
            if restart_costs or start_costs:  # feed the measured cost to the policy
                measured = float(np.mean(restart_costs or start_costs))
                for r in runs:
                    r.job.restart_cost = measured
            if not active and len(arrived) == len(runs):
                break
            stopping = any(r.stopping_since is not None for r in active)
            # a job launched a moment ago may not have installed its stop handler yet
            starting = any(r.launched_at is not None and now - r.launched_at < 0.5 for r in active)
            # GPUs count as free from the stop request on (a stopping job runs at most one more
            # step), as in the simulator; a stopped job relaunches as soon as its ranks exit
            if True:
                for r in active:
                    if not r.procs and r.target is not None and r.alloc != r.target:
                        launch(r, r.target, time.time() - t0)
                        log(f"[{time.time() - t0:6.1f}s] job {r.spec.name}: start on {r.target.n} GPUs")
            if replan and not stopping and not starting:
                replan = False
                now = time.time() - t0
                for r in active:
                    r.job.remaining = float(r.spec.steps - _progress(r.dir))
                jobs = [r.job for r in active]
                new = pol(jobs, cluster, dict(alloc), now)
                check_allocation(jobs, cluster, new)
                for r in active:
                    jid = r.job.job_id
                    old_a, new_a = alloc.get(jid), new.get(jid)
                    if old_a == new_a:
                        continue
                    r.target = new_a
                    if r.procs:  # running: stop at the next step boundary, restart when it exits
                        r.stopping_since = now
                        for p in r.procs:
                            p.send_signal(signal.SIGUSR1)
                        log(f"[{now:6.1f}s] job {r.spec.name}: {old_a.n if old_a else 0} -> "
                            f"{new_a.n if new_a else 0} GPUs (stop/restart)")
                alloc = dict(new)
            time.sleep(poll_s)
    finally:
        for r in runs:
            for p in r.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    jct = {r.spec.name: r.finish - r.spec.arrival for r in runs}
    stats = {}
    for r in runs:
        lines = (r.dir / "stats.jsonl").read_text().splitlines() if (r.dir / "stats.jsonl").exists() else []
        stats[r.spec.name] = [json.loads(x) for x in lines]
    return {"policy": policy, "cluster": cluster.spec, "jct_s": jct, "avg_jct_s": float(np.mean(list(jct.values()))),
            "restarts": sum(r.restarts for r in runs), "restart_costs_s": restart_costs,
            "start_costs_s": start_costs, "stats": stats}


def simulate_workload(specs: list[RealJobSpec], cluster: GpuCluster, policy: str, restart_cost: float,
                      start_cost: float, step_overhead_s: float = 0.0) -> dict:
    """The same workload through the simulator, with the measured costs."""
    from .simulator import simulate

    gtype = cluster.types[0]
    jobs = []
    for i, s in enumerate(specs):
        curve = RingCurve({gtype: s.compute_s}, model_bytes=model_bytes(), bandwidth=3.1e9,
                          overhead_s=step_overhead_s, max_g=s.max_gpus)
        j = make_job(i, s.name, s.arrival, s.steps, curve, cluster, max_gpus=s.max_gpus,
                     restart_cost=restart_cost)
        _even_sizes_only(j, s.batch)
        j.start_cost = start_cost
        jobs.append(j)
    res = simulate(jobs, cluster, policy)
    return {"avg_jct_s": res.avg_jct_s, "restarts": res.restarts,
            "jct_s": {s.name: float(x) for s, x in zip(specs, res.jct)}}


def compare(cluster_spec: str = "cpu:2", policy: str = "doubling", workdir: str | Path = "sched-run",
            specs: list[RealJobSpec] | None = None, log=print) -> dict:
    specs = specs or tiny_workload()
    cluster = parse_cluster_spec(cluster_spec)
    real = run_workload(specs, cluster, policy, workdir, log=log)
    restart = float(np.mean(real["restart_costs_s"])) if real["restart_costs_s"] else 0.0
    start = float(np.mean(real["start_costs_s"])) if real["start_costs_s"] else 0.0
    # per-step overhead beyond the emulated compute, measured on single-process runs
    over = [s["mean_step_s"] for st in real["stats"].values() for s in st
            if s["world"] == 1 and s["mean_step_s"] is not None]
    comp = {sp.name: sp.compute_s for sp in specs}
    over_s = [s["mean_step_s"] - comp[n] for n, st in real["stats"].items() for s in st
              if s["world"] == 1 and s["mean_step_s"] is not None]
    overhead = max(0.0, float(np.median(over_s))) if over else 0.0
    sim = simulate_workload(specs, cluster, policy, restart, start, overhead)
    return {"sim_s": sim["avg_jct_s"], "real_s": real["avg_jct_s"], "ratio": sim["avg_jct_s"] / real["avg_jct_s"],
            "policy": policy, "cluster": cluster.spec, "measured_restart_s": restart, "measured_start_s": start,
            "step_overhead_s": overhead, "real": real, "sim": sim}


def bench_sim_vs_real(workdir: str | Path | None = None) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = compare(workdir=workdir or tmp, log=lambda *a: None)
    out.pop("real", None)
    return out


def run_cli(args) -> int:
    out = compare(args.cluster, args.policy, args.workdir)
    print(f"real average JCT {out['real_s']:.2f} s, simulated {out['sim_s']:.2f} s "
          f"(ratio {out['ratio']:.3f}); restarts {out['real']['restarts']}, "
          f"measured restart {out['measured_restart_s']:.2f} s, cold start {out['measured_start_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return 0
