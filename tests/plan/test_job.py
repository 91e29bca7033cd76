"""Whole-job planning: the cost model's ranking against brute force, memory refusals,
fitting, the plan CLI, and `hetrain launch --plan / --auto` on the demo."""
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from hetrain.cli import main as cli
from hetrain.perf.comm import byteps_split, byteps_time, ring_allreduce_time
from hetrain.perf.job import (CODEC_RATIO, Candidate, Fitted, JobCluster, JobModel, JobWorker, candidates,
                              comm_time, fit, predict, rank)
from hetrain.plan.job import DEFAULT_FITTED, load_job_plan, model_from_profile, plan_job
from hetrain.plan.profile import profile_model
from tests.helpers import repo_env


def synthetic(rng, n: int, k: int):
    bw = float(rng.choice([1e7, 1e8, 1e9]))  # equal NICs: the closed forms apply
    workers = tuple(JobWorker(f"w{i}", float(rng.uniform(1e-4, 5e-3)), bw, float(rng.uniform(0, 5e-3)),
                              price_per_hour=float(rng.uniform(0.5, 3))) for i in range(n))
    # partitions of a micro-byte: pushes and pulls fully pipelined, the closed forms' regime
    cluster = JobCluster(workers, (bw,) * k, (0.3,) * k, partition_bytes=1e-6,
                         paced_before_send=bool(rng.integers(2)))
    model = JobModel("m", float(rng.choice([1e5, 1e6, 1e7])), float(rng.uniform(1e3, 1e5)))
    fitted = Fitted(overhead_s=float(rng.uniform(0, 0.01)), efficiency=float(rng.uniform(0.5, 1.0)),
                    codec_s_per_byte={c: float(rng.uniform(0, 5e-9)) for c in CODEC_RATIO},
                    codec_scale=float(rng.uniform(1, 4)), overlap_s=float(rng.uniform(0, 0.005)))
    return cluster, model, fitted


def brute_step(cand: Candidate, model: JobModel, cluster: JobCluster, batch: int, fitted: Fitted) -> float:
    """Step time by exhaustive search over every integer split of the batch (balanced) and
    the closed-form exchange times, written independently of perf/job.py. Balanced: also
    the k fastest workers alone (by their time for the whole batch), the others sitting
    out, as the runtime may run it: one worker exchanges nothing, several all-reduce fp32."""
    step = _brute_set(cand, model, cluster, batch, fitted)
    if cand.shares != "balanced":
        return step
    w = cluster.workers
    order = sorted(range(len(w)), key=lambda i: (w[i].fixed_s + w[i].per_sample_s * batch, i))
    for k in range(1, len(w)):
        sub = JobCluster(tuple(w[i] for i in order[:k]), cluster.cpu_bandwidth, cluster.cpu_price_per_hour,
                         partition_bytes=cluster.partition_bytes, paced_before_send=cluster.paced_before_send)
        step = min(step, _brute_set(Candidate("allreduce", "balanced", k > 1, "fp32"), model, sub, batch, fitted))
    return step


def _brute_set(cand: Candidate, model: JobModel, cluster: JobCluster, batch: int, fitted: Fitted) -> float:
    n = len(cluster.workers)
    fixed = np.array([w.fixed_s for w in cluster.workers])
    per = np.array([w.per_sample_s for w in cluster.workers])

    def slowest(sizes):
        return max(f + p * b for f, p, b in zip(fixed, per, sizes) if b > 0)

    if cand.shares == "equal":
        compute = slowest([batch // n + (i < batch % n) for i in range(n)])
    else:
        compute = min(slowest(s) for s in itertools.product(range(1, batch + 1), repeat=n) if sum(s) == batch)
    m = model.grad_bytes * CODEC_RATIO[cand.codec]
    bw = cluster.workers[0].bandwidth
    k = len(cluster.cpu_bandwidth)
    comm = 0.0 if n == 1 else {"allreduce": lambda: ring_allreduce_time(m, n, bw),
                               "byteps": lambda: byteps_time(m, n, k, bw),
                               "ps": lambda: max(m, n * m / max(k, 1)) / bw}[cand.mode]() / fitted.efficiency
    codec = 0.0
    if cand.codec != "fp32" and n > 1:  # workers encode+decode M; the busiest server decodes n shares, encodes one
        g = model.grad_bytes
        server = g / k if cand.mode == "ps" else max(byteps_split(n, k, g))
        codec = fitted.codec_s_per_byte[cand.codec] * fitted.codec_scale * (g + (n + 1) / 2 * server)
    exposed = comm + codec
    one_bucket = cand.mode == "allreduce" and model.grad_bytes <= 2**20  # starts after backward: nothing hidden
    if cand.overlap and not one_bucket:
        paced = cand.mode == "allreduce" and cluster.paced_before_send  # no bucket left after backward
        exposed = max(exposed - cluster.overlap_window * compute, 0.0 if paced else exposed / fitted.partitions)
    return compute + exposed + fitted.overhead_s + (fitted.overlap_s if cand.overlap else 0.0)


@pytest.mark.parametrize("seed", range(12))
def test_ranking_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(2, 4)), int(rng.integers(0, 3))
    cluster, model, fitted = synthetic(rng, n, k)
    batch = 9 if n == 3 else 12
    ranked = plan_job(model, cluster, batch, fitted=fitted)
    brute = {c: brute_step(c, model, cluster, batch, fitted) for c in candidates(cluster)}
    assert {p.candidate for p in ranked} == set(brute)
    for p in ranked:
        assert p.step_s == pytest.approx(brute[p.candidate], rel=1e-5)
    assert ranked[0].step_s == pytest.approx(min(brute.values()), rel=1e-5)
    steps = [p.step_s for p in ranked]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(steps, steps[1:]))  # fastest first
    # a throughput target: the cheapest per sample among those reaching it
    target = batch / float(np.median(list(brute.values())))
    best = rank(ranked, target=target)[0]
    ok = [p for p in ranked if p.samples_per_s >= target]
    assert best.dollars_per_million == pytest.approx(min(p.dollars_per_million for p in ok))
    # a budget: the fastest within it
    budget = sorted(p.dollars_per_hour for p in ranked)[len(ranked) // 2]
    best = rank(ranked, budget=budget)[0]
    assert best.samples_per_s == pytest.approx(max(p.samples_per_s for p in ranked if p.dollars_per_hour <= budget))


def test_a_balanced_split_leaves_out_a_worker_whose_exchange_costs_more_than_it_saves():
    """Two equal workers behind a slow link: exchanging 4 MB costs more than the half batch
    the second one computes, so the prediction is the first worker alone (the runtime's
    balancer does the same); with equal shares both stay in and pay the exchange."""
    workers = (JobWorker("a", 4e-3, 7.5e6), JobWorker("b", 4e-3, 7.5e6))
    cluster = JobCluster(workers, (7.5e6,), (0.1,))
    model = JobModel("m", grad_bytes=4e6, act_bytes_per_sample=0.0)
    for mode in ("allreduce", "byteps", "ps"):
        alone = predict(Candidate(mode, "balanced", False, "fp32"), model, cluster, 64)
        assert list(alone.shares) == [64, 0] and alone.step_s == pytest.approx(64 * 4e-3)
        assert alone.ran == Candidate("allreduce", "balanced", False, "fp32") and "b sits out" in alone.why
        both = predict(Candidate(mode, "equal", False, "fp32"), model, cluster, 64)
        assert list(both.shares) == [32, 32] and both.step_s > alone.step_s
    near = JobCluster(tuple(JobWorker(w.name, w.per_sample_s, 1e10) for w in workers))  # a fast link: both help
    assert list(predict(Candidate("allreduce", "balanced", True, "fp32"), model, near, 64).shares) == [32, 32]


def test_no_codec_with_allreduce_and_no_servers_without_cpu_machines():
    cluster = JobCluster((JobWorker("a", 1e-3, 1e9), JobWorker("b", 1e-3, 1e9)))
    cands = candidates(cluster)
    assert {c.mode for c in cands} == {"allreduce"} and {c.codec for c in cands} == {"fp32"}


def test_one_partition_pushes_then_pulls():
    """A gradient in one partition is pushed, summed, then pulled: no overlap of the phases.
    PS, 2 workers, 1 CPU machine, uploads paced only: M/B (push) + 2M/B (pull)."""
    w, c = np.array([1e8, 1e8]), np.array([1e8])
    assert comm_time("ps", 1e6, w, c, duplex=False, partitions=1) == pytest.approx(0.03)
    assert comm_time("ps", 1e6, w, c, duplex=True, partitions=1) == pytest.approx(0.04)  # server receives 2M too
    assert comm_time("ps", 1e6, w, c, duplex=True, partitions=10**9) == pytest.approx(0.02, rel=1e-5)
    assert comm_time("byteps", 1e6, w, c, duplex=True, partitions=10**9) == pytest.approx(
        byteps_time(1e6, 2, 1, 1e8), rel=1e-5)


def test_memory_refuses_a_plan_that_does_not_fit():
    model = JobModel("m", grad_bytes=1e6, act_bytes_per_sample=1e5)
    small = 3e6 + 10 * 1e5  # model state + 10 samples
    cluster = JobCluster((JobWorker("a", 1e-3, 1e9, memory=small), JobWorker("b", 1e-3, 1e9, memory=small)), (1e9,))
    fits = predict(Candidate("byteps", "balanced", False, "fp32"), model, cluster, 20)
    assert fits.fits and list(fits.shares) == [10, 10]
    assert np.all(fits.memory <= small)
    over = predict(Candidate("byteps", "balanced", False, "fp32"), model, cluster, 21)
    assert not over.fits and "does not fit" in over.why
    # a codec's residual takes memory too: at 20 samples fp32 fits, int8 does not
    assert not predict(Candidate("byteps", "balanced", False, "int8"), model, cluster, 20).fits
    ranked = plan_job(model, cluster, 20, fitted=DEFAULT_FITTED)
    assert ranked[0].fits and ranked[0].candidate.codec == "fp32"
    assert not ranked[-1].fits


def test_fit_recovers_overhead_and_efficiency():
    """Fitted on runs with every worker in the step (equal shares, as the calibration runs:
    a balanced split may leave workers out, and which ones depends on the constants)."""
    rng = np.random.default_rng(3)
    cluster, model, _ = synthetic(rng, 3, 2)
    truth = Fitted(overhead_s=0.02, efficiency=0.6)
    obs = []
    for mode in ("allreduce", "byteps", "ps"):
        c = Candidate(mode, "equal", False, "fp32")
        obs.append((predict(c, model, cluster, 12), predict(c, model, cluster, 12, truth).step_s))
    got = fit(obs)
    assert got.overhead_s == pytest.approx(0.02, rel=1e-6) and got.efficiency == pytest.approx(0.6, rel=1e-5)


def test_fit_overhead_from_an_overlapped_all_reduce_alone():
    """An all-reduce job always overlaps: its profiled step alone fits the overhead (what
    `launch --auto` has), and the fitted model reproduces that step."""
    rng = np.random.default_rng(5)
    cluster, model, _ = synthetic(rng, 3, 0)
    cand = Candidate("allreduce", "balanced", True, "fp32")
    truth = Fitted(overhead_s=0.015)
    measured = predict(cand, model, cluster, 12, truth).step_s
    got = fit([(predict(cand, model, cluster, 12), measured)])
    assert got.overhead_s == pytest.approx(0.015, rel=1e-6) and got.overlap_s == 0.0
    assert predict(cand, model, cluster, 12, got).step_s == pytest.approx(measured, rel=1e-9)


def test_rate_limited_all_reduce_leaves_no_bucket_after_backward():
    """Paced before its sends (the in-process limiter), an overlapped all-reduce of several
    buckets hides all of its exchange behind a longer compute; on real links its last piece
    stays exposed."""
    workers = (JobWorker("a", 1e-2, 2.5e7), JobWorker("b", 1e-2, 2.5e7))
    # two buckets (1.25 MB each, over DDP's 1 MiB first cap); ring: 2.5e6 B at 2.5e7 B/s = 0.1 s
    model = JobModel("m", grad_bytes=2.5e6, act_bytes_per_sample=0.0, layer_grad_bytes=(1.25e6, 1.25e6))
    cand = Candidate("allreduce", "equal", True, "fp32")
    paced = predict(cand, model, JobCluster(workers, overlap_window=1.0, paced_before_send=True), 40)
    real = predict(cand, model, JobCluster(workers, overlap_window=1.0), 40)
    assert paced.step_s == pytest.approx(0.2)  # compute 20 x 10 ms; the 0.1 s exchange hidden
    assert real.step_s == pytest.approx(0.2 + 0.1 / Fitted().partitions)


def test_one_bucket_all_reduce_hides_nothing():
    """Gradients that fit one all-reduce bucket start only once backward made the last of
    them (the runtime then sends them at step()), so overlap hides none of the exchange,
    paced or not; a server mode's overlap is unchanged."""
    workers = (JobWorker("a", 1e-2, 1e7), JobWorker("b", 1e-2, 1e7))
    model = JobModel("m", grad_bytes=1e6, act_bytes_per_sample=0.0, layer_grad_bytes=(4e5, 6e5))
    cand = Candidate("allreduce", "equal", True, "fp32")
    for cluster in (JobCluster(workers, overlap_window=1.0, paced_before_send=True), JobCluster(workers)):
        p = predict(cand, model, cluster, 40)
        assert p.step_s == pytest.approx(0.2 + 0.1) and p.comm_s == pytest.approx(0.1)


def test_an_all_reduce_among_processes_of_one_host_is_memcpy_bound():
    """Every worker on one node, links not emulated: the runtime's all-reduce goes through
    shared memory (comm/shm/), and the cost model prices it by the bytes each process
    reads and writes at the host's memcpy speed (bench/colocated.py's bound), shared
    where the processes outnumber the cores; not by the NICs."""
    from hetrain.cluster.spec import default_cluster
    from hetrain.perf.comm import SHM_BYTES_PER_BYTE, SHM_BYTES_PER_SLICE, shm_allreduce_time
    from hetrain.plan.job import job_cluster

    # bench/colocated.py's memcpy_bound for buckets in the segments: (1.5 - 0.5/n)·N/S·n/min(n, cores)
    k, d = SHM_BYTES_PER_BYTE, SHM_BYTES_PER_SLICE
    assert (k, d) == (3.0, -1.0)
    for n, cores in ((2, 2), (4, 2), (4, 16)):
        assert shm_allreduce_time(1e8, n, 1e10, cores) == pytest.approx((1.5 - 0.5 / n) * 1e8 / 1e10 * n / min(n, cores))
    assert shm_allreduce_time(1e8, 1, 1e10, 2) == 0.0
    workers = tuple(JobWorker(w, 1e-3, 1.25e9) for w in "abcd")
    model = JobModel("m", grad_bytes=1e8, act_bytes_per_sample=0.0)
    cand = Candidate("allreduce", "equal", False, "fp32")
    shm = predict(cand, model, JobCluster(workers, shared_memory=True, memcpy_speed=1e10, cores=2), 40)
    nic = predict(cand, model, JobCluster(workers), 40)
    assert shm.comm_s == pytest.approx((k + d / 4) * 1e8 / 2e10 * 2)  # 27.5 ms, not the ring's
    assert nic.comm_s == pytest.approx(ring_allreduce_time(1e8, 4, 1.25e9))  # 120 ms over 10 Gbit/s NICs
    byteps = Candidate("byteps", "equal", False, "fp32")  # summation servers: over their links, as before
    assert predict(byteps, model, JobCluster(workers, (1.25e9,), shared_memory=True), 40).comm_s == pytest.approx(
        predict(byteps, model, JobCluster(workers, (1.25e9,)), 40).comm_s)
    # the plan's view of a cluster file: one node without emulated links, or links emulated
    local = job_cluster(default_cluster(), cost_per_sample=1e-3)
    assert local.shared_memory and local.memcpy_speed > 0 and local.cores >= 1
    assert not job_cluster(default_cluster().with_emulation("ratelimit"), cost_per_sample=1e-3).shared_memory


@pytest.mark.parametrize("name", ["ctr-small", "transformer-small", "cnn-small"])
def test_bucket_count_is_the_runtimes(name):
    """The cost model's bucket count from the profile's layers is the runtime's (DDP's caps
    over the model's tensors, comm/buckets.py)."""
    from hetrain.comm.buckets import DDP_CAPS
    from hetrain.models.zoo import build_model
    from hetrain.perf.job import allreduce_buckets

    model = build_model(name)
    numels = [p.numel() for p in model.parameters()]
    profile = profile_model(model, batch=2, repeats=1)
    assert allreduce_buckets(model_from_profile(profile)) == len(DDP_CAPS.plan(numels))


CLUSTER = """name: tiny
machines:
  - {name: w0, role: worker, device: {kind: fast, speed: 1.0, memory: 64MiB}, bandwidth: 1gbit}
  - {name: w1, role: worker, device: {kind: slow, speed: 0.5, memory: 64MiB}, bandwidth: 1gbit}
"""


def test_plan_cli_ranks_writes_and_refuses(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    out = tmp_path / "plan.json"
    rc = cli(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", "digits", "--cost-per-sample", "0.001",
              "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "samples/s" in text and "$/1M" in text and "allreduce/balanced" in text
    plan = load_job_plan(out)
    assert plan.config.mode == "allreduce" and plan.config.balance == "measured"
    assert sum(plan.predicted.shares.values()) == 64 and plan.predicted.shares["w0"] > plan.predicted.shares["w1"]
    assert plan.script[:2] == ["-m", "hetrain.demo.digits"]
    (tmp_path / "small.yaml").write_text(CLUSTER.replace("64MiB", "100KiB"))
    rc = cli(["plan", "--cluster", str(tmp_path / "small.yaml"), "--model", "digits", "--cost-per-sample", "0.001",
              "--out", str(out)])
    assert rc == 1 and "no candidate fits" in capsys.readouterr().err
    assert cli(["plan", "--model", "digits", "--out", str(out)]) == 2  # neither --cluster nor --catalogue


def _launch(*args: str, timeout: int = 300):
    env = repo_env()
    proc = subprocess.run([sys.executable, "-m", "hetrain.cli", "launch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_launch_plan_runs_the_demo_and_records_its_prediction(tmp_path):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    plan = tmp_path / "plan.json"
    assert cli(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", "digits", "--cost-per-sample", "0.001",
                "--out", str(plan), "--epochs", "1"]) == 0
    run = tmp_path / "run"
    proc = _launch("--plan", str(plan), "--run-dir", str(run))
    check = json.loads((run / "summary.json").read_text())["prediction"]
    assert check["candidate"] == load_job_plan(plan).ranking[0]["candidate"]
    assert check["measured_step_s"] > 0 and check["predicted_step_s"] > 0
    assert set(check["measured_memory"]) == {"w0", "w1"} and all(v > 0 for v in check["measured_memory"].values())
    assert "predicted step" in proc.stdout


@pytest.mark.slow
def test_launch_auto_profiles_plans_and_continues(tmp_path):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    run = tmp_path / "run"
    proc = _launch("--auto", "--auto-steps", "6", "--cluster", str(tmp_path / "c.yaml"), "--mode", "allreduce",
                   "--run-dir", str(run), "-m", "hetrain.demo.digits", "--epochs", "1",
                   "--cost-per-sample", "0.001")
    assert "profiling 6 steps" in proc.stdout and "continuing with" in proc.stdout
    plan = load_job_plan(run / "plan.json")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["prediction"]["candidate"] == plan.ranking[0]["candidate"]
    assert "resumed from commit" in proc.stdout  # the planned round continued the profiled one


class _LinearRelu(torch.nn.Module):
    kind = "dense"

    def __init__(self, n_in: int, n_out: int, relu: bool):
        super().__init__()
        self.fc, self.relu = torch.nn.Linear(n_in, n_out), relu

    def forward(self, x):
        y = self.fc(x)
        return (torch.relu(y) if self.relu else y,)


class _TwoLayers(torch.nn.Module):
    """8 -> 16 (ReLU) -> 4: a chain the saved-tensor count can be worked out by hand for."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_LinearRelu(8, 16, True), _LinearRelu(16, 4, False)])

    def layer_list(self):
        return [(f"l{i}", m, m.kind) for i, m in enumerate(self.layers)]

    def example_inputs(self, batch, generator=None):
        return (torch.randn(batch, 8, generator=generator),)


def test_profile_counts_what_autograd_saves_for_backward():
    """Layer 0 keeps its input (8 floats, for the weight's gradient) and its ReLU output
    (16 floats); layer 1 keeps its input, which is that same ReLU output: counted once, on
    layer 0. Weights saved for backward are model state, not activations. The outputs
    alone (the cut bytes) would be 16 and 4 floats."""
    prof = profile_model(_TwoLayers(), "two", batch=8, repeats=1)
    assert [l.stored_act_bytes for l in prof.layers] == [4 * (8 + 16), 0.0]
    assert [l.act_bytes for l in prof.layers] == [4 * 16, 4 * 4]
    assert model_from_profile(prof).act_bytes_per_sample == 4 * (8 + 16)


def test_memory_counts_saved_tensors_and_refuses():
    """A device sized for the model state plus the layers' outputs only (what the profile
    recorded before saved tensors were counted) cannot hold the batch: refused."""
    prof = profile_model(_TwoLayers(), "two", batch=8, repeats=1)
    model = model_from_profile(prof)
    outputs_only = sum(l.act_bytes for l in prof.layers)
    mem = model.state_factor * model.grad_bytes + 32 * outputs_only
    cluster = JobCluster((JobWorker("a", 1e-3, 1e9, memory=mem), JobWorker("b", 1e-3, 1e9, memory=mem)))
    assert not predict(Candidate("allreduce", "equal", False, "fp32"), model, cluster, 64).fits
    roomy = JobCluster(tuple(JobWorker(w, 1e-3, 1e9, memory=mem * 2) for w in "ab"))
    assert predict(Candidate("allreduce", "equal", False, "fp32"), model, roomy, 64).fits
