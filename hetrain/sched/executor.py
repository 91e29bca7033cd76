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
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..cluster.hardware import Inventory
from ..errors import UserError
from ..perf.goodput import BatchModel
from ..perf.jobs import JobFit, RingCurve, StepSample, fit_job, rate_table
from .backends import LOCAL, Backend, launch_job, ray_gpu_pools
from .cluster import parse_cluster_spec
from .job import Alloc, RealJobSpec, make_job, use_goodput
from .policies import DEFAULT_POLICY, check_allocation, get_policy
from .progress import JobRun, measured_step_times, read_progress, sample_of
from .worker import EXIT_STOPPED

# What the executor assumes about a job's network before it has run on two or more
# GPUs: the default NIC of a cluster file (MachineSpec.bandwidth, 10 Gbit/s). The fit
# replaces it with the bandwidth the job measures.
PRIOR_BANDWIDTH = 1.25e9


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


# ---- the executor ----------------------------------------------------------------------

def run_workload(specs: list[RealJobSpec], cluster: Inventory, policy, workdir: str | Path,
                 backend: Backend = LOCAL, speeds: dict[str, float] | None = None, restart_cost: float = 3.0,
                 poll_s: float = 0.05, timeout_s: float = 300.0, log=print) -> dict:
    """Run the jobs for real; returns JCTs, restarts, measured costs, fits and decision overheads.

    `speeds` emulates GPU types: a job computes compute_s / speeds[type] per global batch.
    """
    return _WorkloadRun(specs, cluster, policy, workdir, backend, speeds, restart_cost, log).run(poll_s, timeout_s)


def _prepare_job_dir(workdir: Path, spec: RealJobSpec) -> Path:
    """The job's directory, emptied of a previous run's progress, logs and elastic commits."""
    d = workdir / spec.name
    d.mkdir(parents=True, exist_ok=True)
    for f in ("progress", "stats.jsonl", "launcher.log"):
        (d / f).unlink(missing_ok=True)
    shutil.rmtree(d / "elastic", ignore_errors=True)  # the job's commits (hetrain.elastic.State)
    return d


def _check_batches(s: RealJobSpec) -> None:
    """Every world size a job may get must split its batches evenly; reject the spec up front."""
    if any(b % g for b in (s.batch, s.max_batch or s.batch) for g in range(1, s.max_gpus + 1)):
        raise UserError(f"job {s.name}: batch {s.batch} and max_batch {s.max_batch} must divide by every "
                        f"size up to {s.max_gpus}")
    if s.max_batch and (s.max_batch < s.batch or s.max_batch % s.batch):
        raise UserError(f"job {s.name}: max_batch {s.max_batch} must be a multiple of the batch {s.batch}")


class _WorkloadRun:
    """One real run of a workload: the polling loop and its state.

    The loop polls every job's progress and launcher (`_poll_job`), relaunches stopped jobs
    at their decided allocation (`_relaunch_stopped`) and calls the policy on arrivals,
    completions and rounds (`_replan`), as the simulator does. A class rather than one long
    function so that the job bookkeeping, the restart path and the result collection can
    each be read on their own.
    """

    def __init__(self, specs: list[RealJobSpec], cluster: Inventory, policy, workdir: str | Path,
                 backend: Backend, speeds: dict[str, float] | None, restart_cost: float, log) -> None:
        self.pol = get_policy(policy) if isinstance(policy, str) else policy
        if hasattr(self.pol, "fresh"):
            self.pol = self.pol.fresh()  # no state (GPU prices, learned lengths) from an earlier run
        self.policy_name = getattr(self.pol, "policy_name", getattr(self.pol, "__name__", str(policy)))
        self.speeds = {t: 1.0 for t in cluster.names} | dict(speeds or {})
        if any(not self.speeds[t] > 0 for t in cluster.names):
            raise UserError(f"emulated GPU speeds must be > 0, got {self.speeds}")
        self.cluster, self.backend, self.log = cluster, backend, log
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.runs: list[JobRun] = []
        for i, s in enumerate(specs):
            _check_batches(s)
            d = _prepare_job_dir(workdir, s)
            prior = RingCurve({t: s.compute_s / self.speeds[t] for t in cluster.names}, model_bytes=model_bytes(),
                              bandwidth=PRIOR_BANDWIDTH, max_g=s.max_gpus)
            job = make_job(i, s.name, s.arrival, s.steps, prior, cluster, max_gpus=s.max_gpus,
                           restart_cost=restart_cost)
            self.runs.append(JobRun(s, job, d, prior))
        self.restart_costs: list[float] = []
        self.start_costs: list[float] = []
        self.finish_costs: list[float] = []  # last step to the launcher's exit (the GPUs are held meanwhile)
        self.decision_ms: list[float] = []
        self.alloc: dict[int, Alloc] = {}
        self.active: list[JobRun] = []
        self.arrived: set[int] = set()
        self.replan = True
        self.t0 = time.time()

    def now(self) -> float:
        return time.time() - self.t0

    # ---- one job ----

    def launch(self, r: JobRun, a: Alloc, now: float) -> None:
        """Start the job's launcher at allocation `a` (a cold start or a restart)."""
        t = self.cluster.names[a.type]
        r.proc = launch_job(r.dir, a.n, ["--steps", str(r.spec.steps), "--batch", str(r.job.batch_for(a) or r.spec.batch),
                                         "--base-batch", str(r.spec.batch), "--seed", str(r.spec.seed),
                                         "--noise-scale", str(r.spec.noise_scale),
                                         "--compute-s", f"{r.spec.compute_s / self.speeds[t]:.6f}"],
                            backend=self.backend, gpu_type=t)
        r.alloc, r.launched_at, r.launch_step = a, now, read_progress(r.dir).step
        r.live = None
        if r.fit is not None:
            r.predicted.setdefault((t, a.n), r.fit.step_time(t, a.n))
        else:
            r.predicted.setdefault((t, a.n), r.prior.step_time(t, a.n))
        if not r.first_launch:
            r.restarts += 1
            r.job.restarts += 1  # what the policy sees (Sia's restart penalty reads it)
        r.job.started = True

    def refit(self, r: JobRun) -> None:
        """Fit the job's ring curve (and goodput model) to what it measured, for the policy."""
        r.fit = fit_job(r.all_samples(), r.prior, r.spec.batch)
        r.job.base_rates = rate_table(r.fit.curve(r.spec.max_gpus), self.cluster.names, r.spec.max_gpus)
        _even_sizes_only(r.job.base_rates, r.spec.batch)
        if r.spec.max_batch > r.spec.batch:  # goodput at the noise scale the workers measured
            noise = read_progress(r.dir).noise_scale if r.samples or r.live else r.spec.noise_scale
            model = batch_model(r.spec, r.fit, noise)
            r.job.goodput_rates, r.job.batch_table = model.goodput_table(r.job.base_rates, self.cluster.names)
            r.job.base_batch = r.spec.batch
        use_goodput([r.job], getattr(self.pol, "adapts_batch", False))

    def _measure_launch_cost(self, r: JobRun) -> None:
        """On the first step after a (re)launch: time the cold start or the stop/restart."""
        model = r.fit or fit_job([], r.prior)
        step_s = model.step_time(self.cluster.names[r.alloc.type], r.alloc.n)
        cost = max(0.0, self.now() - r.launched_at - step_s)
        if r.first_launch:
            self.start_costs.append(cost)
            r.first_launch = False
        elif r.pending_cost is not None:
            self.restart_costs.append(r.pending_cost + cost)
        r.pending_cost = None
        r.launched_at = None

    def _on_exit(self, r: JobRun, code: int) -> None:
        """The job's launcher exited: finished, stopped for a new allocation, or failed."""
        r.proc = None
        if r.live:
            r.samples.append(r.live)
            r.live = None
        if code in (-signal.SIGUSR1, EXIT_STOPPED) and read_progress(r.dir).work >= r.spec.steps - 1e-6:
            code = 0  # it had finished when a late stop request reached it (its last commit says done)
        if code == 0:
            r.finish = self.now()
            r.job.attained = float(r.spec.steps)  # a finished job's length is known from now on
            self.finish_costs.append(max(0.0, time.time() - read_progress(r.dir).time))
            self.active.remove(r)
            self.alloc.pop(r.job.job_id, None)
            self.log(f"[{r.finish:6.1f}s] job {r.spec.name} finished (JCT {r.finish - r.spec.arrival:.1f}s)")
            self.replan = True
        elif code == EXIT_STOPPED:
            r.pending_cost = self.now() - r.stopping_since
            r.stopping_since = None
            r.alloc = None
        else:
            tail = (r.dir / "launcher.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"job {r.spec.name} failed (launcher exit code {code}):\n{tail}")

    def _poll_job(self, r: JobRun) -> None:
        prog = read_progress(r.dir)
        if r.alloc is not None and prog.step > r.launch_step and prog.world == r.alloc.n:
            r.live = sample_of(prog, self.cluster.names[r.alloc.type])  # this run's steps so far
        if r.launched_at is not None and prog.step > r.launch_step:
            self._measure_launch_cost(r)
        if r.proc is not None and r.proc.poll() is not None:
            self._on_exit(r, r.proc.returncode)

    # ---- the workload ----

    def _admit_arrivals(self, now: float) -> None:
        for r in self.runs:
            if r.job.job_id not in self.arrived and r.spec.arrival <= now:
                self.arrived.add(r.job.job_id)
                self.active.append(r)
                self.replan = True

    def _share_measured_costs(self) -> None:
        """Feed the measured restart and cold-start costs to the policy (every job alike)."""
        if self.restart_costs or self.start_costs:
            for r in self.runs:
                r.job.restart_cost = float(np.mean(self.restart_costs or self.start_costs))
                r.job.start_cost = float(np.mean(self.start_costs or self.restart_costs))

    def _relaunch_stopped(self) -> None:
        # GPUs count as free from the stop request on (a stopping job runs at most one more
        # step), as in the simulator; a stopped job relaunches as soon as its ranks exit,
        # with the allocation of the latest decision
        for r in self.active:
            if r.proc is None and r.target is not None and r.alloc != r.target:
                self.launch(r, r.target, self.now())
                self.log(f"[{self.now():6.1f}s] job {r.spec.name}: start on {r.target.n} "
                         f"{self.cluster.names[r.target.type]}")

    def _replan(self, now: float) -> None:
        """Refit every active job, ask the policy, and send a stop request to each running job
        whose allocation changed (it restarts at the new one once its ranks exit)."""
        t_dec = time.perf_counter()
        for r in self.active:
            r.job.attained = min(float(r.spec.steps), read_progress(r.dir).work)
            r.job.remaining = max(0.0, r.spec.steps - r.job.attained)
            r.job.length_known = True  # a RealJobSpec declares its steps, and the executor tells them
            self.refit(r)
        jobs = [r.job for r in self.active]
        new = self.pol(jobs, self.cluster, dict(self.alloc), now)
        check_allocation(jobs, self.cluster, new)
        self.decision_ms.append(1e3 * (time.perf_counter() - t_dec))
        for r in self.active:
            jid = r.job.job_id
            old_a, new_a = self.alloc.get(jid), new.get(jid)
            if old_a == new_a:
                continue
            r.target = new_a
            if r.proc is not None and r.stopping_since is None:
                # running: stop at the next step boundary, restart when it exits
                r.stopping_since = now
                r.proc.send_signal(signal.SIGUSR1)
            self.log(f"[{now:6.1f}s] job {r.spec.name}: {_describe(old_a, self.cluster)} -> "
                     f"{_describe(new_a, self.cluster)}" + (" (stop/restart)" if r.proc is not None else ""))
        self.alloc = dict(new)

    def _stop_all(self) -> None:
        """Terminate every launcher still running (on success none is; on an error, all)."""
        for r in self.runs:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
                try:
                    r.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()

    def run(self, poll_s: float, timeout_s: float) -> dict:
        for r in self.runs:
            self.refit(r)  # the prior (no samples yet), with goodput where the job may change its batch
        round_s = getattr(self.pol, "round_s", None)  # round-based policies (Gavel) re-plan every round too
        last_plan = last_poll = 0.0
        try:
            while True:
                now = self.now()
                for r in self.active:  # GPU-seconds held per type, as the simulator keeps them
                    if r.alloc is not None:
                        r.job.service_s[r.alloc.type] += now - last_poll
                last_poll = now
                if round_s and self.active and now - last_plan >= round_s:
                    self.replan = True
                if now > timeout_s:
                    raise RuntimeError(f"workload did not finish in {timeout_s} s")
                self._admit_arrivals(now)
                for r in list(self.active):
                    self._poll_job(r)
                self._share_measured_costs()
                if not self.active and len(self.arrived) == len(self.runs):
                    break
                self._relaunch_stopped()
                if self.replan:  # on arrivals and completions, as the simulator (a stop request waits
                    # in a launcher that is still starting: it starts with SIGUSR1 blocked)
                    self.replan = False
                    now = last_plan = self.now()
                    self._replan(now)
                time.sleep(poll_s)
        finally:
            self._stop_all()
        return self.results()

    def results(self) -> dict:
        """JCTs, restarts, the measured costs, the final fits and the decision overheads."""
        runs = self.runs
        for r in runs:
            self.refit(r)
        jct = {r.spec.name: r.finish - r.spec.arrival for r in runs}
        return {"policy": self.policy_name, "cluster": self.cluster.spec, "backend": self.backend.kind, "jct_s": jct,
                "avg_jct_s": float(np.mean(list(jct.values()))),
                "restarts": sum(r.restarts for r in runs), "restart_costs_s": self.restart_costs,
                "start_costs_s": self.start_costs, "finish_costs_s": self.finish_costs,
                "decision_ms": self.decision_ms,
                "fits": {r.spec.name: _fit_dict(r.fit, r.spec) for r in runs},
                "step_times": measured_step_times(runs, self.cluster.names),
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
    # the executor tells its policy each job's remaining steps (a RealJobSpec declares them),
    # so the simulated counterpart does too
    res = simulate(jobs, cluster, policy, lengths="known")
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
            samples[g] = sample_of(read_progress(d), gpu_type)
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
