"""The real-device profile and host catalogue behind `bench/heterps.py --real`, on the
CPU (the GPU type measured on the CPU too, as `--cpu-dry-run` does)."""
import numpy as np

from hetrain.perf.pipeline import CostParams
from hetrain.pipeline.hostprofile import (HostDevices, gpu_price, host_catalogue, link_bandwidth, real_profile,
                                          runtime_layer_times, stage_loop_time)
from hetrain.plan.base import Problem
from hetrain.plan.planners import get_planner


def test_profile_catalogue_and_plan_of_this_host():
    dev = HostDevices("gpu", "NVIDIA H100 80GB HBM3", 80 * 2**30, "cpu1t", 1, 2, 8 * 2**30)
    times = runtime_layer_times("cpu", 64, threads=1, runs=2, repeats=1)
    assert len(times) == 14 and all(t > 0 for t in times)
    assert stage_loop_time("cpu", 64, threads=1, steps=1, micro_batches=2) > 0
    prof = real_profile(dev, 64, gpu_device="cpu", runs=2, repeats=1)
    assert set(prof.measured) == {"gpu", "cpu1t"} and prof.batch == 64
    assert [l.time_s for l in prof.layers] == list(prof.measured["cpu1t"])  # the CPU type is the reference
    cat = host_catalogue(dev, link_bandwidth(50_000, messages=8))
    assert cat.names == ("gpu", "cpu1t")
    price, source = gpu_price(dev.gpu_name)
    assert price == cat.kinds[0].price_per_hour == 98.32 / 8 and "H100" in source
    assert cat.kinds[1].price_per_hour == 0.68 / 16 and cat.counts == (1, 2)
    w = prof.workload(cat)
    assert np.allclose(w.compute[:, 0], prof.measured["gpu"])  # measured times, not speed factors
    res = get_planner("exact").plan(Problem(w, 10.0, CostParams(batch_size=1024)))
    assert res.feasible
    assert gpu_price("Some Future GPU")[1].startswith("Some Future GPU is not in the price table")
