"""Real executor: runs a small workload of real training jobs under a scheduling policy,
calling the policy exactly as the simulator does (on every arrival and completion).

Each job runs through hetrain's single launcher (`hetrain launch --mode allreduce -m
hetrain.sched.worker`) with as many worker machines as the decision gives it GPUs, on
one of two backends (`Backend`): `local` starts the processes on this host (an
emulated GPU pool), `ray` asks a Ray cluster for the GPUs of each decision
(`hetrain launch --ray`: a placement group of GPU bundles of the decided type, given
back when the job stops). Every decision (start, resize, change of GPU type, stop) is
applied the same way: SIGUSR1 to the job's launcher, which passes it to the ranks;
they agree on a step boundary, commit their elastic state atomically and exit with
EXIT_STOPPED, and the job restarts at its new allocation from the commit.

Fit, then schedule (as AdaptDL does): rank 0 reports the seconds each step spends
computing and communicating; before every decision the executor re-fits each job's
ring curve to what its runs measured so far (`perf.jobs.fit_job`: overhead, compute
per GPU type, bandwidth, latency; the job's declared compute and a prior bandwidth
fill what was not measured yet) and the policy plans on the fitted rates. Every
stop/restart (signal to the first step at the new size, minus one step) and every
cold start is timed, and their running means become the jobs' `restart_cost` and
`start_cost`, which the policy charges. `compare` then simulates the same workload
with the final fitted curves and the measured costs (a job's cold start plus its
teardown, from the last step to the launcher's exit, as the simulator's start cost) and
reports simulated versus real average JCT; a real JCT ends when the launcher exits,
i.e. when the job's GPUs are free again.
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
from typing import Literal, Sequence

import numpy as np

from ..cluster.hardware import Inventory
from ..errors import UserError
from ..perf.goodput import BatchModel
from ..perf.jobs import JobFit, RingCurve, StepSample, fit_job, rate_table
from .cluster import gpu_pools, parse_cluster_spec
from .job import Alloc, Job, make_job, use_goodput
from .policies import DEFAULT_POLICY, check_allocation, get_policy
from .worker import EXIT_STOPPED

# What the executor assumes about a job's network before it has run on two or more
# GPUs: the default NIC of a cluster file (MachineSpec.bandwidth, 10 Gbit/s). The fit
# replaces it with the bandwidth the job measures.
PRIOR_BANDWIDTH = 1.25e9


@dataclass
class RealJobSpec:
    name: str
    arrival: float
    steps: int
    compute_s: float          # emulated compute of one global batch on one GPU of speed 1
    batch: int = 32           # base batch: steps, compute_s count at it
    seed: int = 0
    max_gpus: int = 2
    max_batch: int = 0        # > batch: a goodput-aware policy may run the job at up to this batch
    noise_scale: float = float("inf")  # assumed until the workers measure it


def tiny_workload() -> list[RealJobSpec]:
    """Three small jobs (a minute of emulated compute in all; at most 2 ranks each): `a`
    runs alone on the whole pool, then `b` and `c` arrive while it runs (a cold start
    takes 10-30 s on a loaded 2-core host), so the policy resizes or preempts it for real.
    Each job may run at its base batch 32 or at 64 (a goodput-aware policy picks)."""
    return [RealJobSpec("a", 0.0, 160, 0.40, seed=1, max_batch=64),
            RealJobSpec("b", 40.0, 24, 0.30, seed=2, max_batch=64),
            RealJobSpec("c", 50.0, 30, 0.40, seed=3, max_batch=64)]


def model_bytes(dim: int = 16) -> float:
    """Gradient bytes of the worker's MLP (dim -> 64 -> 1, fp32)."""
    return 4.0 * (dim * 64 + 64 + 64 + 1)


# ---- backends --------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    """Where a job's processes run: `local` (this host, an emulated pool) or `ray`."""

    kind: Literal["local", "ray"] = "local"
    address: str | None = None            # ray: the cluster's GCS address, or auto
    gpu_resource: str = "GPU"             # ray: resource that counts GPUs (custom for emulated ones)
    cpus_per_process: float = 0.5         # ray: CPUs reserved for each rank

    def __post_init__(self) -> None:
        if self.kind == "ray" and not self.address:
            raise UserError("the ray backend needs the cluster's address: --address HOST:PORT (or auto)")

    def machine_kind(self, gpu_type: str) -> str:
        # on Ray the device kind picks the node's GPU type (accelerator_type:<KIND>)
        return gpu_type if self.kind == "ray" else "emulated-gpu"

    def launch_flags(self) -> list[str]:
        if self.kind == "local":
            return []
        return ["--ray", self.address, "--ray-gpu-resource", self.gpu_resource,
                "--ray-cpus", str(self.cpus_per_process)]


LOCAL = Backend()


def ray_gpu_pools(backend: Backend) -> Inventory:
    """The GPU pools of a Ray cluster: GPUs per type, from each node's `gpu_resource` count
    and its `accelerator_type:<TYPE>` marker."""
    try:
        import ray
    except ImportError:
        raise UserError("the ray backend needs Ray: pip install 'hetrain[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=backend.address, namespace="hetrain", log_to_driver=False, logging_level="WARNING")
    pools: dict[str, int] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node["Resources"]
        n = int(res.get(backend.gpu_resource, 0))
        types = [k.split(":", 1)[1].lower() for k in res if k.startswith("accelerator_type:")]
        if n and types:
            pools[types[0]] = pools.get(types[0], 0) + n
    if not pools:
        raise UserError(f"the Ray cluster at {backend.address} has no typed GPUs: no node has both "
                        f"{backend.gpu_resource!r} and an accelerator_type:<TYPE> resource")
    return gpu_pools(tuple(pools), tuple(pools.values()), name=f"ray:{backend.address}")


def launch_job(job_dir: Path, world: int, worker_args: list[str], quiet: bool = True,
               backend: Backend = LOCAL, gpu_type: str = "gpu") -> subprocess.Popen:
    """Start one job of `world` ranks with `hetrain launch`; returns the launcher process
    (its output goes to launcher-<world>.log in the job directory when quiet)."""
    import yaml

    cluster = {"name": f"job-{world}", "machines": [
        {"name": f"g{i}", "role": "worker", "device": {"kind": backend.machine_kind(gpu_type)}}
        for i in range(world)]}
    cfile = job_dir / f"cluster-{world}-{gpu_type}.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", *backend.launch_flags(), "--cluster", str(cfile),
           "--mode", "allreduce", "--run-dir", str(job_dir / "run")] + (["--quiet"] if quiet else []) + \
          ["-m", "hetrain.sched.worker", "--job-dir", str(job_dir), *worker_args]
    out = (job_dir / "launcher.log").open("ab") if quiet else subprocess.PIPE
    # the launcher starts with SIGUSR1 blocked and unblocks it once its handler is in place
    # (hetrain.runtime.catch_stop_requests): a stop request sent while Python starts waits
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out,
                                stderr=subprocess.STDOUT)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if quiet:
            out.close()


# ---- measurements ----------------------------------------------------------------------

@dataclass(frozen=True)
class Progress:
    step: int = 0
    time: float = 0.0       # wall clock of the step's end
    world: int = 0
    timed: int = 0          # steps of the current run after its first
    compute_s: float = 0.0  # their summed compute seconds (rank 0)
    comm_s: float = 0.0     # their summed communication seconds
    work: float = 0.0       # base-batch steps of work done (statistical efficiency counted)
    batch: int = 0          # this run's global batch
    noise_scale: float = float("inf")  # as the workers measure it


def read_progress(d: Path) -> Progress:
    try:
        f = (d / "progress").read_text().split()
        return Progress(int(f[0]), float(f[1]), int(f[2]), int(f[3]), float(f[4]), float(f[5]),
                        float(f[6]), int(f[7]), float(f[8]))
    except (OSError, ValueError, IndexError):
        return Progress()


@dataclass
class _Run:
    spec: RealJobSpec
    job: Job
    dir: Path
    prior: RingCurve
    proc: subprocess.Popen | None = None
    alloc: Alloc | None = None
    target: Alloc | None = None
    stopping_since: float | None = None
    launched_at: float | None = None
    launch_step: int = 0
    pending_cost: float | None = None   # stop duration, to add to the restart's start time
    first_launch: bool = True
    finish: float | None = None
    restarts: int = 0
    samples: list = field(default_factory=list)   # StepSample of each finished run
    live: StepSample | None = None                # the current run's, so far
    fit: JobFit | None = None
    # (type, size) -> step time the fit predicted when the job was first started there
    predicted: dict = field(default_factory=dict)

    def all_samples(self) -> list[StepSample]:
        return self.samples + ([self.live] if self.live else [])


def _sample(p: Progress, gpu_type: str) -> StepSample | None:
    if p.timed <= 0 or p.world <= 0:
        return None
    return StepSample(gpu_type, p.world, p.timed, p.compute_s / p.timed, p.comm_s / p.timed, p.batch)


def measured_step_times(runs: Sequence[_Run], types: Sequence[str]) -> list[dict]:
    """Per job and size: measured mean step, the final fit's prediction, and the prediction
    the fit made before the job first ran at that size."""
    out = []
    for r in runs:
        by: dict[tuple[str, int], list[StepSample]] = {}
        for s in r.all_samples():
            by.setdefault((s.gpu_type, s.g), []).append(s)
        for (t, g), ss in sorted(by.items()):
            n = sum(s.steps for s in ss)
            meas = sum(s.step_s * s.steps for s in ss) / n
            out.append({"job": r.spec.name, "gpu_type": t, "gpus": g, "steps": n, "measured_s": meas,
                        "fitted_s": r.fit.step_time(t, g) if r.fit else None,
                        "predicted_before_s": r.predicted.get((t, g))})
    return out


# ---- the executor ----------------------------------------------------------------------

def run_workload(specs: list[RealJobSpec], cluster: Inventory, policy, workdir: str | Path,
                 backend: Backend = LOCAL, speeds: dict[str, float] | None = None, restart_cost: float = 3.0,
                 poll_s: float = 0.05, timeout_s: float = 300.0, log=print) -> dict:
    """Run the jobs for real; returns JCTs, restarts, measured costs, fits and decision overheads.

    `speeds` emulates GPU types: a job computes compute_s / speeds[type] per global batch.
    """
    pol = get_policy(policy) if isinstance(policy, str) else policy
    policy = getattr(pol, "policy_name", getattr(pol, "__name__", str(policy)))
    speeds = {t: 1.0 for t in cluster.names} | dict(speeds or {})
    if any(not speeds[t] > 0 for t in cluster.names):
        raise UserError(f"emulated GPU speeds must be > 0, got {speeds}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    runs: list[_Run] = []
    for i, s in enumerate(specs):
        if any(b % g for b in (s.batch, s.max_batch or s.batch) for g in range(1, s.max_gpus + 1)):
            raise UserError(f"job {s.name}: batch {s.batch} and max_batch {s.max_batch} must divide by every "
                            f"size up to {s.max_gpus}")
        if s.max_batch and (s.max_batch < s.batch or s.max_batch % s.batch):
            raise UserError(f"job {s.name}: max_batch {s.max_batch} must be a multiple of the batch {s.batch}")
        d = workdir / s.name
        d.mkdir(parents=True, exist_ok=True)
        for f in ("progress", "stats.jsonl", "launcher.log"):
            (d / f).unlink(missing_ok=True)
        shutil.rmtree(d / "elastic", ignore_errors=True)  # the job's commits (hetrain.elastic.State)
        prior = RingCurve({t: s.compute_s / speeds[t] for t in cluster.names}, model_bytes=model_bytes(),
                          bandwidth=PRIOR_BANDWIDTH, max_g=s.max_gpus)
        job = make_job(i, s.name, s.arrival, s.steps, prior, cluster, max_gpus=s.max_gpus,
                       restart_cost=restart_cost)
        runs.append(_Run(s, job, d, prior))
    restart_costs: list[float] = []
    start_costs: list[float] = []
    finish_costs: list[float] = []  # last step to the launcher's exit (the GPUs are held meanwhile)
    decision_ms: list[float] = []
    t0 = time.time()
    alloc: dict[int, Alloc] = {}

    def launch(r: _Run, a: Alloc, now: float) -> None:
        t = cluster.names[a.type]
        r.proc = launch_job(r.dir, a.n, ["--steps", str(r.spec.steps), "--batch", str(r.job.batch_for(a) or r.spec.batch),
                                         "--base-batch", str(r.spec.batch), "--seed", str(r.spec.seed),
                                         "--noise-scale", str(r.spec.noise_scale),
                                         "--compute-s", f"{r.spec.compute_s / speeds[t]:.6f}"],
                            backend=backend, gpu_type=t)
        r.alloc, r.launched_at, r.launch_step = a, now, read_progress(r.dir).step
        r.live = None
        if r.fit is not None:
            r.predicted.setdefault((t, a.n), r.fit.step_time(t, a.n))
        else:
            r.predicted.setdefault((t, a.n), r.prior.step_time(t, a.n))
        if not r.first_launch:
            r.restarts += 1
        r.job.started = True

    def refit(r: _Run) -> None:
        r.fit = fit_job(r.all_samples(), r.prior, r.spec.batch)
        r.job.base_rates = rate_table(r.fit.curve(r.spec.max_gpus), cluster.names, r.spec.max_gpus)
        _even_sizes_only(r.job.base_rates, r.spec.batch)
        if r.spec.max_batch > r.spec.batch:  # goodput at the noise scale the workers measured
            noise = read_progress(r.dir).noise_scale if r.samples or r.live else r.spec.noise_scale
            model = batch_model(r.spec, r.fit, noise)
            r.job.goodput_rates, r.job.batch_table = model.goodput_table(r.job.base_rates, cluster.names)
            r.job.base_batch = r.spec.batch
        use_goodput([r.job], getattr(pol, "adapts_batch", False))

    for r in runs:
        refit(r)  # the prior (no samples yet), with goodput where the job may change its batch
    active: list[_Run] = []
    arrived: set[int] = set()
    replan = True
    round_s = getattr(pol, "round_s", None)  # round-based policies (Gavel) re-plan every round too
    last_plan = last_poll = 0.0
    try:
        while True:
            now = time.time() - t0
            for r in active:  # GPU-seconds held per type, as the simulator keeps them
                if r.alloc is not None:
                    r.job.service_s[r.alloc.type] += now - last_poll
            last_poll = now
            if round_s and active and now - last_plan >= round_s:
                replan = True
            if now > timeout_s:
                raise RuntimeError(f"workload did not finish in {timeout_s} s")
            for r in runs:
                if r.job.job_id not in arrived and r.spec.arrival <= now:
                    arrived.add(r.job.job_id)
                    active.append(r)
                    replan = True
            for r in list(active):
                prog = read_progress(r.dir)
                if r.alloc is not None and prog.step > r.launch_step and prog.world == r.alloc.n:
                    r.live = _sample(prog, cluster.names[r.alloc.type])  # this run's steps so far
                # cost measurement: first step after a (re)launch
                if r.launched_at is not None and prog.step > r.launch_step:
                    model = r.fit or fit_job([], r.prior)
                    step_s = model.step_time(cluster.names[r.alloc.type], r.alloc.n)
                    cost = max(0.0, (time.time() - t0) - r.launched_at - step_s)
                    if r.first_launch:
                        start_costs.append(cost)
                        r.first_launch = False
                    elif r.pending_cost is not None:
                        restart_costs.append(r.pending_cost + cost)
                    r.pending_cost = None
                    r.launched_at = None
                if r.proc is not None and r.proc.poll() is not None:
                    code = r.proc.returncode
                    r.proc = None
                    if r.live:
                        r.samples.append(r.live)
                        r.live = None
                    if code in (-signal.SIGUSR1, EXIT_STOPPED) and read_progress(r.dir).work >= r.spec.steps - 1e-6:
                        code = 0  # it had finished when a late stop request reached it (its last commit says done)
                    if code == 0:
                        r.finish = time.time() - t0
                        finish_costs.append(max(0.0, time.time() - read_progress(r.dir).time))
                        active.remove(r)
                        alloc.pop(r.job.job_id, None)
                        log(f"[{r.finish:6.1f}s] job {r.spec.name} finished (JCT {r.finish - r.spec.arrival:.1f}s)")
                        replan = True
                    elif code == EXIT_STOPPED:
                        r.pending_cost = time.time() - t0 - r.stopping_since
                        r.stopping_since = None
                        r.alloc = None
                    else:
                        tail = (r.dir / "launcher.log").read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"job {r.spec.name} failed (launcher exit code {code}):\n{tail}")
            if restart_costs or start_costs:  # feed the measured costs to the policy
                for r in runs:
                    r.job.restart_cost = float(np.mean(restart_costs or start_costs))
                    r.job.start_cost = float(np.mean(start_costs or restart_costs))
            if not active and len(arrived) == len(runs):
                break
            # GPUs count as free from the stop request on (a stopping job runs at most one more
            # step), as in the simulator; a stopped job relaunches as soon as its ranks exit,
            # with the allocation of the latest decision
            for r in active:
                if r.proc is None and r.target is not None and r.alloc != r.target:
                    launch(r, r.target, time.time() - t0)
                    log(f"[{time.time() - t0:6.1f}s] job {r.spec.name}: start on {r.target.n} "
                        f"{cluster.names[r.target.type]}")
            if replan:  # on arrivals and completions, as the simulator (a stop request waits
                # in a launcher that is still starting: it starts with SIGUSR1 blocked)
                replan = False
                now = last_plan = time.time() - t0
                t_dec = time.perf_counter()
                for r in active:
                    r.job.remaining = max(0.0, r.spec.steps - read_progress(r.dir).work)
                    refit(r)
                jobs = [r.job for r in active]
                new = pol(jobs, cluster, dict(alloc), now)
                check_allocation(jobs, cluster, new)
                decision_ms.append(1e3 * (time.perf_counter() - t_dec))
                for r in active:
                    jid = r.job.job_id
                    old_a, new_a = alloc.get(jid), new.get(jid)
                    if old_a == new_a:
                        continue
                    r.target = new_a
                    if r.proc is not None and r.stopping_since is None:
                        # running: stop at the next step boundary, restart when it exits
                        r.stopping_since = now
                        r.proc.send_signal(signal.SIGUSR1)
                    log(f"[{now:6.1f}s] job {r.spec.name}: {_describe(old_a, cluster)} -> "
                        f"{_describe(new_a, cluster)}" + (" (stop/restart)" if r.proc is not None else ""))
                alloc = dict(new)
            time.sleep(poll_s)
    finally:
        for r in runs:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
                try:
                    r.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
    for r in runs:
        refit(r)
    jct = {r.spec.name: r.finish - r.spec.arrival for r in runs}
    return {"policy": policy, "cluster": cluster.spec, "backend": backend.kind, "jct_s": jct,
            "avg_jct_s": float(np.mean(list(jct.values()))),
            "restarts": sum(r.restarts for r in runs), "restart_costs_s": restart_costs,
            "start_costs_s": start_costs, "finish_costs_s": finish_costs, "decision_ms": decision_ms,
            "fits": {r.spec.name: _fit_dict(r.fit, r.spec) for r in runs},
            "step_times": measured_step_times(runs, cluster.names),
            "noise_scale": {r.spec.name: read_progress(r.dir).noise_scale for r in runs},
            "_curves": {r.spec.name: (r.fit, read_progress(r.dir).noise_scale) for r in runs}}


def _describe(a: Alloc | None, cluster: Inventory) -> str:
    return f"{a.n} {cluster.names[a.type]}" if a else "0 GPUs"


def _fit_dict(f: JobFit, spec: RealJobSpec) -> dict:
    return {"overhead_s": f.overhead_s, "compute_per_sample_s": {t: c / spec.batch for t, c in f.compute_s.items()},
            "bandwidth_Bps": f.bandwidth, "latency_s": f.latency, "measured": sorted(f.measured)}


def batch_model(spec: RealJobSpec, fit: JobFit, noise_scale: float) -> BatchModel:
    """The job's goodput model: its batch range, the fitted compute per sample per type."""
    return BatchModel(spec.batch, spec.max_batch, noise_scale,
                      {t: c / spec.batch for t, c in fit.compute_s.items()}, {})


def _even_sizes_only(rates: np.ndarray, batch: int) -> None:
    """World sizes must split the global batch evenly (e.g. no 3 ranks for batch 32)."""
    for g in range(1, rates.shape[1]):
        if batch % g:
            rates[:, g] = 0.0


def simulate_workload(specs: list[RealJobSpec], cluster: Inventory, policy, restart_cost: float,
                      start_cost: float, curves: dict[str, tuple[JobFit, float]]) -> dict:
    """The same workload through the simulator, with the fitted curves and measured costs."""
    from .simulator import simulate

    jobs = []
    for i, s in enumerate(specs):
        fit, noise = curves[s.name]
        model = batch_model(s, fit, noise) if s.max_batch > s.batch else None
        j = make_job(i, s.name, s.arrival, s.steps, fit.curve(s.max_gpus), cluster, max_gpus=s.max_gpus,
                     restart_cost=restart_cost, batch_model=model)
        for table in (j.base_rates, j.goodput_rates):
            if table is not None:
                _even_sizes_only(table, s.batch)
        j.start_cost = start_cost
        jobs.append(j)
    res = simulate(jobs, cluster, policy)
    return {"avg_jct_s": res.avg_jct_s, "restarts": res.restarts,
            "jct_s": {s.name: float(x) for s, x in zip(specs, res.jct)}}


def compare(cluster_spec: str | None = "cpu:2", policy=DEFAULT_POLICY, workdir: str | Path = "sched-run",
            specs: list[RealJobSpec] | None = None, backend: Backend = LOCAL,
            speeds: dict[str, float] | None = None, log=print) -> dict:
    """Run a workload for real on `backend`, then simulate it with what the run measured."""
    specs = specs or tiny_workload()
    if cluster_spec:
        cluster = parse_cluster_spec(cluster_spec)
    elif backend.kind == "ray":
        cluster = ray_gpu_pools(backend)
    else:
        raise UserError("give the emulated GPU pool with --cluster, e.g. cpu:2")
    real = run_workload(specs, cluster, policy, workdir, backend=backend, speeds=speeds, log=log)
    restart = float(np.mean(real["restart_costs_s"])) if real["restart_costs_s"] else 0.0
    start = float(np.mean(real["start_costs_s"])) if real["start_costs_s"] else 0.0
    finish = float(np.mean(real["finish_costs_s"])) if real["finish_costs_s"] else 0.0
    # a job's one-off overheads, its cold start and its teardown (GPUs held from the last step
    # to the launcher's exit), are charged together as the simulator's start cost
    sim = simulate_workload(specs, cluster, policy, restart or start, start + finish, real.pop("_curves"))
    return {"backend": backend.kind, "sim_s": sim["avg_jct_s"], "real_s": real["avg_jct_s"],
            "ratio": sim["avg_jct_s"] / real["avg_jct_s"], "policy": real["policy"], "cluster": cluster.spec,
            "restart_s": restart, "start_s": start, "finish_s": finish,
            "decision_ms": float(np.mean(real["decision_ms"])) if real["decision_ms"] else 0.0,
            "real": real, "sim": sim}


def bench_sim_vs_real(backend: Backend = LOCAL, cluster_spec: str | None = "cpu:2", policy: str = DEFAULT_POLICY,
                      speeds: dict[str, float] | None = None, workdir: str | Path | None = None) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return compare(cluster_spec, policy, workdir or tmp, backend=backend, speeds=speeds, log=lambda *a: None)


def fit_sweep(sizes: Sequence[int] = (1, 2, 4), steps: int = 16, compute_s: float = 0.4,
              workdir: str | Path | None = None, backend: Backend = LOCAL, gpu_type: str = "gpu") -> list[dict]:
    """How well the fitted ring curve predicts a job's step time at each size: the same job
    runs `steps` steps at every size; the curve is fitted to all sizes (in-sample) and, for
    each size, to the other sizes only (a prediction for a size never measured)."""
    import tempfile

    prior = RingCurve({gpu_type: compute_s}, model_bytes=model_bytes(), bandwidth=PRIOR_BANDWIDTH, max_g=max(sizes))
    samples: dict[int, StepSample] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(workdir or tmp)
        for g in sizes:
            d = root / f"fit-{g}"
            d.mkdir(parents=True, exist_ok=True)
            for f in ("progress", "launcher.log"):
                (d / f).unlink(missing_ok=True)
            shutil.rmtree(d / "elastic", ignore_errors=True)
            proc = launch_job(d, g, ["--steps", str(steps), "--compute-s", str(compute_s)], backend=backend,
                              gpu_type=gpu_type)
            if proc.wait() != 0:
                raise RuntimeError(f"fit sweep at {g} GPUs failed:\n" + (d / "launcher.log").read_text()[-2000:])
            samples[g] = _sample(read_progress(d), gpu_type)
    full = fit_job(list(samples.values()), prior)
    rows = []
    for g, smp in samples.items():
        others = fit_job([x for h, x in samples.items() if h != g], prior)
        rows.append({"gpus": g, "steps": smp.steps, "measured_s": smp.step_s, "compute_s": smp.compute_s,
                     "comm_s": smp.comm_s, "fitted_s": full.step_time(gpu_type, g),
                     "left_out_s": others.step_time(gpu_type, g)})
    return rows


def run_cli(args) -> int:
    backend = Backend(args.backend, address=args.address, gpu_resource=args.ray_gpu_resource) \
        if args.backend == "ray" else LOCAL
    cluster = args.cluster or (None if args.backend == "ray" else "cpu:2")
    out = compare(cluster, args.policy, args.workdir, backend=backend)
    print(f"{backend.kind}: real average JCT {out['real_s']:.2f} s, simulated {out['sim_s']:.2f} s "
          f"(ratio {out['ratio']:.3f}); restarts {out['real']['restarts']}, "
          f"measured restart {out['restart_s']:.2f} s, cold start {out['start_s']:.2f} s, "
          f"teardown {out['finish_s']:.2f} s, {out['decision_ms']:.1f} ms per decision")
    print(f"{'job':<5}{'GPUs':>10}{'steps':>7}{'measured s':>12}{'fitted s':>10}{'error':>8}")
    for row in out["real"]["step_times"]:
        err = row["fitted_s"] / row["measured_s"] - 1
        print(f"{row['job']:<5}{str(row['gpus']) + ' ' + row['gpu_type']:>10}{row['steps']:>7}"
              f"{row['measured_s']:>12.4f}{row['fitted_s']:>10.4f}{err:>+8.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return 0
