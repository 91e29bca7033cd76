import numpy as np
import pytest

from hetrain.perf.comm import ring_allreduce_time
from hetrain.perf.jobs import RingCurve, TableCurve, fit_ring, rate_table
from hetrain.sched.cluster import ClusterArgError, parse_cluster_spec


def test_ring_curve_is_ring_maths():
    c = RingCurve({"v100": 0.8}, model_bytes=1e8, bandwidth=1e9, latency=1e-4, overhead_s=0.01)
    for g in (1, 2, 4, 8):
        expect = 0.01 + 0.8 / g + ring_allreduce_time(1e8, g, 1e9, 1e-4)
        assert c.step_time("v100", g) == pytest.approx(expect)
        assert c.rate("v100", g) == pytest.approx(1 / expect)
    assert c.rate("k80", 1) == 0.0
    weak = RingCurve({"v100": 0.5}, model_bytes=1e8, bandwidth=1e9, weak=True)
    assert weak.rate("v100", 4) == pytest.approx(4 / (0.5 + ring_allreduce_time(1e8, 4, 1e9)))


def test_ring_curve_rejects_bad_values():
    with pytest.raises(ValueError, match="compute_s"):
        RingCurve({"v100": 0.0})
    with pytest.raises(ValueError, match="bandwidth"):
        RingCurve({"v100": 1.0}, bandwidth=0)


def test_fit_ring_recovers_coefficients():
    g = np.array([1, 2, 3, 4, 6, 8])
    true = 0.05 + 1.2 / g + 0.3 * 2 * (g - 1) / g + 0.01 * 2 * (g - 1)
    fit = fit_ring(g, true, comm_s=0.3, latency_term=True)
    assert (fit.a, fit.b, fit.c, fit.d) == pytest.approx((0.05, 1.2, 0.3, 0.01), rel=1e-6)
    np.testing.assert_allclose(fit.step_time(g), true)


def test_fit_ring_keeps_coefficients_non_negative():
    fit = fit_ring([1, 2, 4], [1.0, 0.5, 0.25])  # perfect scaling: no comm, no fixed cost
    assert min(fit.a, fit.b, fit.c) >= 0
    assert fit.b == pytest.approx(1.0)


def test_table_curve_interpolates_and_stops_at_first_zero():
    c = TableCurve({"v100": {1: 10.0, 2: 18.0, 4: 30.0}, "k80": {1: 3.0, 2: 0.0, 4: 5.0}})
    assert c.rate("v100", 3) == pytest.approx(24.0)
    assert c.rate("v100", 8) == 0.0 and c.max_gpus("v100") == 4
    assert c.max_gpus("k80") == 1 and c.rate("k80", 4) == 0.0
    t = rate_table(c, ["v100", "k80", "p100"], 4)
    assert t.shape == (3, 5) and t[0, 0] == 0 and t[2].sum() == 0 and t[0, 4] == 30.0


def test_cluster_specs():
    c = parse_cluster_spec("v100:8, K80:4")
    assert c.names == ("v100", "k80") and c.total == 12 and c.largest_pool == 8
    g = parse_cluster_spec("300:300:300")
    assert g.names == ("v100", "p100", "k80") and g.total == 900
    for bad, msg in [("v100", "TYPE:COUNT"), ("v100:x", "TYPE:COUNT"), ("v100:0", ">= 1"), ("v100:2,v100:3", "twice")]:
        with pytest.raises(ClusterArgError, match=msg):
            parse_cluster_spec(bad)


def test_cluster_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: lab\ngpus: {v100: 2, k80: 6}\n")
    c = parse_cluster_spec(str(f))
    assert c.counts == (2, 6) and c.name == "lab"
    f.write_text("gpus: {v100: two}\n")
    with pytest.raises(ClusterArgError, match="gpus.v100"):
        parse_cluster_spec(str(f))


def test_fit_predicts_the_step_at_the_batch_a_job_ran():
    """A job run at twice its base batch is predicted at that batch: comparing its measured
    step with the base-batch prediction would read about 50% off with a perfect fit."""
    from hetrain.perf.jobs import StepSample, fit_job

    truth = RingCurve({"v100": 0.4}, model_bytes=4e6, bandwidth=1e9, overhead_s=0.02)
    prior = RingCurve({"v100": 1.0}, model_bytes=4e6, bandwidth=5e8)
    samples = []
    for g, ratio in ((1, 1), (2, 2), (4, 2)):
        comm = truth.step_time("v100", g) - 0.02 - 0.4 / g
        samples.append(StepSample("v100", g, 50, 0.02 + ratio * 0.4 / g, comm, batch=32 * ratio))
    fit = fit_job(samples, prior, base_batch=32)
    for s in samples:
        assert fit.step_time("v100", s.g, s.batch / 32) == pytest.approx(s.step_s, rel=1e-6)
    assert fit.step_time("v100", 2) == pytest.approx(truth.step_time("v100", 2), rel=1e-6)
    assert fit.step_time("v100", 2) / samples[1].step_s < 0.6  # the old comparison: about 47% off
