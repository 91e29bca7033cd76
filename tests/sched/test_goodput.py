"""Goodput model (noise scale, efficiency, best batch) and the goodput policy's integer program."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.errors import UserError
from hetrain.perf.goodput import (BatchModel, NoiseSample, NoiseScaleTracker, efficiency, fit_noise_scale,
                                  fit_one_gpu, scale_lr)
from hetrain.perf.jobs import TableCurve
from hetrain.sched.cluster import gpu_pools, parse_cluster_spec
from hetrain.sched.job import Alloc, make_job, use_goodput
from hetrain.sched.patterns import make_pattern
from hetrain.sched.policies import check_allocation, get_policy
from hetrain.sched.policies.goodput import exhaustive, objective, solve
from hetrain.sched.policies.mckp import DECOMPOSE_GAP
from hetrain.sched.simulator import simulate


def synthetic_noise(phi_true: float, steps: int, workers: int, local_batch: int, dim: int = 64, seed: int = 0):
    """Per-sample gradients G + N(0, s^2 I): tr(Sigma) = dim s^2 and phi = tr(Sigma) / |G|^2."""
    rng = np.random.default_rng(seed)
    G = rng.normal(size=dim)
    s = np.sqrt(phi_true * (G @ G) / dim)
    out = []
    for _ in range(steps):
        # each worker's mean gradient over its local batch
        local = G + rng.normal(scale=s / np.sqrt(local_batch), size=(workers, dim))
        glob = local.mean(axis=0)
        out.append(NoiseSample(local_sqr=float((local ** 2).sum(axis=1).mean()), global_sqr=float(glob @ glob),
                               local_batch=local_batch, global_batch=local_batch * workers))
    return out


@pytest.mark.parametrize("phi,workers,b", [(100.0, 2, 16), (1000.0, 4, 32), (5000.0, 8, 64)])
def test_noise_scale_fit_recovers_the_known_scale(phi, workers, b):
    samples = synthetic_noise(phi, steps=400, workers=workers, local_batch=b)
    assert fit_noise_scale(samples) == pytest.approx(phi, rel=0.10)
    tracker = NoiseScaleTracker(smoothing=0.99)
    for smp in samples:
        tracker.update(smp)
    assert tracker.noise_scale == pytest.approx(phi, rel=0.25)  # an EMA keeps ~100 steps: noisier


def test_noise_scale_needs_two_workers():
    one = [NoiseSample(1.0, 1.0, 32, 32)]
    with pytest.raises(UserError, match="2 or more workers"):
        fit_noise_scale(one)
    assert NoiseScaleTracker(prior=7.0).noise_scale == 7.0


def test_efficiency_and_lr_rules():
    assert efficiency(32, 32, 100.0) == 1.0
    assert efficiency(64, 32, 100.0) == pytest.approx(132 / 164)
    assert efficiency(1024, 32, float("inf")) == 1.0
    assert scale_lr(0.1, 32, 128) == pytest.approx(0.2)
    assert scale_lr(0.1, 32, 128, "linear") == pytest.approx(0.4)
    with pytest.raises(UserError, match="learning-rate rule"):
        scale_lr(0.1, 32, 64, "cubic")


def test_one_gpu_profile_fit():
    a, c = fit_one_gpu([16, 32, 64, 128], [0.02 + 0.001 * b for b in (16, 32, 64, 128)])
    assert (a, c) == (pytest.approx(0.02), pytest.approx(0.001))


def test_goodput_table_best_batch_memory_and_base():
    rates = np.array([[0.0, 10.0, 15.0, 18.0, 20.0]])  # comm-bound scaling at the base batch 32
    model = BatchModel(base_batch=32, max_batch=512, noise_scale=1000.0, per_sample_s={"v100": 1e-4},
                       max_local={"v100": 128})
    good, batch = model.goodput_table(rates, ["v100"])
    assert np.all(good[0, 1:] >= rates[0, 1:] * (1 - 1e-12))       # the base batch is always a choice
    assert np.all(np.ceil(batch[0, 1:] / np.arange(1, 5)) <= 128)  # per-GPU share fits memory
    # by hand, 4 GPUs at 512: (512/32) E(512) / (1/20 + 1e-4 (512-32)/4)
    want = 16 * (1032 / 1512) / (0.05 + 1e-4 * 480 / 4)
    assert batch[0, 4] == 512 and good[0, 4] == pytest.approx(want)
    flat = BatchModel(32, 512, 0.0, {"v100": 1e-4}, {})  # no noise: a larger batch never pays
    g0, b0 = flat.goodput_table(rates, ["v100"])
    assert np.allclose(g0, rates) and set(b0[0, 1:].tolist()) == {32}


@st.composite
def instances(draw):
    types = ("v100", "k80")
    counts = tuple(draw(st.integers(1, 4)) for _ in types)
    cluster = gpu_pools(types, counts)
    jobs, alloc = [], {}
    free = list(counts)
    for i in range(draw(st.integers(1, 4))):
        rates = {}
        for t in types:
            r1 = draw(st.floats(0.5, 10))
            effs = [draw(st.floats(0.3, 1.0)) for _ in range(3)]
            rates[t] = {1: r1, 2: 2 * r1 * effs[0], 3: 3 * r1 * effs[1], 4: 4 * r1 * effs[2]}
        job = make_job(i, f"j{i}", 0.0, draw(st.floats(10, 1e4)), TableCurve(rates), cluster,
                       restart_cost=draw(st.floats(0, 50)))
        job.started = draw(st.booleans())
        t = draw(st.integers(0, 1))
        n = draw(st.integers(1, 3))
        if job.started and free[t] >= n and draw(st.booleans()):
            alloc[job.job_id] = Alloc(t, n)  # running now: moving costs a restart
            free[t] -= n
        jobs.append(job)
    return cluster, jobs, alloc, draw(st.sampled_from([0.5, 1.0, 2.0]))


@settings(max_examples=60, deadline=None)
@given(instances())
def test_milp_is_optimal_by_enumeration(inst):
    cluster, jobs, alloc, p = inst
    plan = solve(jobs, cluster, alloc, p)
    check_allocation(jobs, cluster, plan)
    best, _ = exhaustive(jobs, cluster, alloc, p)
    assert objective(jobs, cluster, alloc, plan, p) >= best * (1 - DECOMPOSE_GAP) - 1e-12


def test_goodput_policy_runs_jobs_at_their_best_batch():
    cluster = parse_cluster_spec("v100:4,p100:4,k80:4")
    jobs = make_pattern("poisson", 12, cluster, seed=1)
    assert any(j.goodput_rates is not None for j in jobs)
    res = simulate(jobs, cluster, "goodput")
    assert np.all(np.isfinite(res.finish))
    # the simulator handed the policy goodput rates; a fixed-batch policy gets the base ones back
    j = next(j for j in jobs if j.goodput_rates is not None)
    assert j.rates is j.goodput_rates and j.batch_for(Alloc(0, 1)) == j.batch_table[0, 1]
    use_goodput(jobs, False)
    assert j.rates is j.base_rates and j.batch_for(Alloc(0, 1)) == j.base_batch


def test_goodput_policy_prefers_a_short_job_and_charges_restarts():
    cluster = gpu_pools(("v100",), (1,))
    curve = TableCurve({"v100": {1: 1.0}})
    long, short = (make_job(i, f"j{i}", 0.0, w, curve, cluster, restart_cost=30.0) for i, w in enumerate((1000, 10)))
    pol = get_policy("goodput")
    assert pol([long, short], cluster, {}, 0.0) == {1: Alloc(0, 1)}
    # a running job on 1 of 2 GPUs: growing to 2 saves 9.5 s of its 20, less than a 30 s restart
    two = gpu_pools(("v100",), (2,))
    job = make_job(0, "j", 0.0, 20.0, TableCurve({"v100": {1: 1.0, 2: 1.9}}), two, restart_cost=30.0)
    job.started = True  # and has run 100 s (Pollux's re-allocation factor keeps a job of age 0 put)
    assert pol.fresh()([job], two, {0: Alloc(0, 1)}, 100.0) == {0: Alloc(0, 1)}
    job.restart_cost = 1.0
    assert pol.fresh()([job], two, {0: Alloc(0, 1)}, 100.0) == {0: Alloc(0, 2)}
