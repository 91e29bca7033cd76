"""What a real-device run pays beyond the profile (pipeline/calibrate.py): the micro-batch
choice, per-type calibration, fill and drain, and a target that needs the GPU. Pure
logic on synthetic profiles of the runtime's CTR model, so it runs without CUDA."""
import pytest

from hetrain.errors import UserError
from hetrain.perf.pipeline import CostParams
from hetrain.pipeline.calibrate import (choose_micro_batches, fill_drain_s, gpu_target, micro_batch_choices,
                                        scaled_profile, type_factor, with_fill_drain)
from hetrain.pipeline.hostprofile import HostDevices, host_catalogue
from hetrain.pipeline.workload import emulated_profile
from hetrain.plan.base import Problem
from hetrain.plan.planners import get_planner

DEV = HostDevices("gpu", "NVIDIA H200", 140 * 2**30, "cpu4t", 4, 3, 8 * 2**30)
CAT = host_catalogue(DEV, 4e9)


def profile(cpu_us: float, gpu_us: float):
    """The CTR model with every layer at `cpu_us` / `gpu_us` microseconds per sample."""
    base = emulated_profile()
    n = len(base.layers)
    cpu, gpu = (cpu_us * 1e-6,) * n, (gpu_us * 1e-6,) * n
    layers = tuple(l.model_copy(update={"time_s": cpu[0]}) for l in base.layers)
    return base.model_copy(update={"layers": layers, "measured": {"cpu4t": cpu, "gpu": gpu}})


def test_micro_batch_choices_keep_every_replica_count():
    assert micro_batch_choices(65536, 32, replicas=3) == [36, 12, 6]  # multiples of 1, 2 and 3
    assert micro_batch_choices(65536, 32) == [32, 8, 2]
    assert micro_batch_choices(4, 32) == [4, 2]  # never more micro-batches than samples
    with pytest.raises(UserError, match="must be >= 1"):
        micro_batch_choices(64, 0)


def test_the_gpu_is_planned_at_the_micro_batch_where_it_is_fast():
    """Launch-bound at small micro-batches (slower than a CPU worker), fast at large ones:
    the count whose best plan is fastest is the large micro-batch's, and its plan puts
    the GPU to work."""
    small, large = profile(0.4, 0.5), profile(0.4, 0.02)  # 32 micro-batches of 2048 vs 8 of 8192
    count, reach = choose_micro_batches({32: small, 8: large}, CAT, 65536)
    assert count == 8 and reach[8] > 2 * reach[32]
    problem = Problem(large.workload(CAT), 0.9 * reach[8], CostParams(batch_size=65536))
    res = get_planner("exact").plan(problem)
    assert res.feasible and any(st.rtype == CAT.index("gpu") for st in res.score.stages)


def test_equal_counts_prefer_more_micro_batches():
    same = profile(0.4, 0.5)
    assert choose_micro_batches({32: same, 8: same}, CAT, 65536)[0] == 32  # fill and drain are shorter


def test_calibration_scales_each_type_by_its_run():
    p = profile(0.4, 0.1)
    f = {"gpu": type_factor(1000.0, 500.0), "cpu4t": type_factor(300.0, 250.0)}
    assert f == {"gpu": 2.0, "cpu4t": pytest.approx(1.2)}
    q = scaled_profile(p, f)
    assert q.measured["gpu"] == pytest.approx([2.0 * t for t in p.measured["gpu"]])
    assert q.measured["cpu4t"] == pytest.approx([1.2 * t for t in p.measured["cpu4t"]])
    assert [l.time_s for l in q.layers] == pytest.approx(list(q.measured["cpu4t"]))  # the reference type follows
    with pytest.raises(UserError, match="no measured times"):
        scaled_profile(p, {"tpu": 2.0})
    with pytest.raises(UserError, match="positive throughputs"):
        type_factor(1000.0, 0.0)


def test_fill_and_drain_are_one_micro_batch_of_the_other_stages():
    p = profile(0.4, 0.05)
    w = p.workload(CAT)
    gpu, cpu = CAT.index("gpu"), CAT.index("cpu4t")
    problem = Problem(w, 100_000.0, CostParams(batch_size=4096))
    score = problem.evaluate((cpu,) * 10 + (gpu,) * 4)
    assert score.feasible and len(score.stages) == 2
    slow = min(score.stages, key=lambda st: st.throughput)
    other = next(st for st in score.stages if st is not slow)
    assert fill_drain_s(score, 512) == pytest.approx(512 * other.time_per_sample)
    assert with_fill_drain(score.throughput, 4096, score, 512) == pytest.approx(
        4096 / (4096 / score.throughput + 512 * other.time_per_sample))
    one = problem.evaluate((cpu,) * 14)
    assert fill_drain_s(one, 512) == 0.0  # one stage: nothing to fill


def test_the_target_needs_the_gpu_only_where_it_helps():
    assert gpu_target(1000.0, 400.0) == 700.0  # halfway between the CPUs alone and the best
    assert gpu_target(1000.0, 990.0) == 500.0  # the GPU adds under 5%: half the best
