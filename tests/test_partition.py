import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import parse_cluster
from hetrain.comm.partition import bytes_per_server, largest_remainder, plan_partitions
from hetrain.perf.comm import byteps_split, byteps_time, optimal_split, ring_allreduce_time
from hetrain.runtime.topology import build_topology


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(1, 3_000_000), n=st.integers(1, 8), k=st.integers(0, 8),
       part=st.integers(1_000, 1_100_000))
def test_partitions_follow_the_optimal_split_exactly(numel, n, k, part):
    if n == 1 and k == 0:
        return
    m_cpu, m_gpu = byteps_split(n, k)
    shares = np.array([m_gpu] * n + [m_cpu] * k) if k <= n else np.array([0.0] * n + [1.0 / k] * k)
    parts = plan_partitions(numel, shares, part)
    # contiguous cover of the flat buffer, in priority (offset) order
    assert [p.start for p in parts] == list(np.cumsum([0] + [p.length for p in parts[:-1]]))
    assert sum(p.length for p in parts) == numel
    got = bytes_per_server(parts, len(shares), itemsize=1)
    want = largest_remainder(numel, shares)
    assert np.array_equal(got, want)  # exact: each server holds its optimal byte count
    assert np.all(np.abs(got - shares / shares.sum() * numel) < 1.0)
    # every partition is at most about partition_bytes
    assert max(p.length for p in parts) <= part + 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 16), k=st.integers(0, 16))
def test_lp_split_reproduces_closed_form(n, k):
    plan = optimal_split(1.0, np.ones(n), np.ones(k))
    assert plan.time_s == pytest.approx(byteps_time(1.0, n, k, 1.0), rel=1e-6)
    if 0 < k <= n and n > 2:  # at n = 2 every split is optimal (the (n-2)·m_i term vanishes)
        m_cpu, m_gpu = byteps_split(n, k)
        assert np.allclose(plan.cpu_bytes, m_cpu, atol=1e-6)
        assert np.allclose(plan.gpu_bytes, m_gpu, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(3, 12), k=st.integers(0, 12), bw=st.sampled_from([1e6, 5e7, 1.25e9, 1.25e10, 5e10]))
def test_lp_split_is_scale_free(n, k, bw):
    """Real NIC speeds (up to 400 Gbit/s) must not degrade the LP (a bug once: 10 Gbit/s)."""
    plan = optimal_split(8e6, np.full(n, bw), np.full(k, bw))
    assert plan.time_s == pytest.approx(byteps_time(8e6, n, k, bw), rel=1e-6)
    if k == 0:
        assert np.allclose(plan.gpu_bytes, 8e6 / n, rtol=1e-6)


def test_special_cases_of_the_formula():
    n, m, b = 8, 1e8, 1e9
    assert byteps_time(m, n, 0, b) == pytest.approx(ring_allreduce_time(m, n, b))  # k=0 is all-reduce
    assert byteps_time(m, n, n, b) == pytest.approx(m / b)  # k=n is PS
    assert byteps_time(m, n, 2 * n, b) == pytest.approx(m / b)


def test_topology_modes():
    c = parse_cluster({"machines": [{"name": f"w{i}", "role": "worker", "device": {}} for i in range(4)]
                       + [{"name": f"c{j}", "role": "cpu"} for j in range(2)]})
    t = build_topology(c, "byteps")
    assert len(t.workers) == 4 and len(t.servers) == 6
    assert [round(s.share, 6) for s in t.servers] == [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]
    assert len(build_topology(c, "ps").servers) == 2
    assert len(build_topology(c, "colocated").servers) == 4
    assert build_topology(c, "allreduce").world_size == 4


@settings(max_examples=100, deadline=None)
@given(numel=st.integers(1, 500_000), n=st.integers(2, 6), k=st.integers(1, 6), part=st.integers(1_000, 200_000))
def test_lanes_keep_the_split_and_equalise_flows(numel, n, k, part):
    from hetrain.comm.partition import lanes_for, split_lanes

    m_cpu, m_gpu = byteps_split(n, k)
    shares = np.array([m_gpu] * n + [m_cpu] * k)
    base = plan_partitions(numel, shares, part)
    lanes = lanes_for(shares, max_lanes=8)
    parts = split_lanes(base, lanes)
    assert np.array_equal(bytes_per_server(parts, len(shares)), bytes_per_server(base, len(shares)))
    assert [p.pid for p in parts] == list(range(len(parts)))
    assert sum(p.length for p in parts) == numel and all(p.lane < lanes[p.server] for p in parts)
    if k < n and numel > 100 * part:  # bytes per connection about equal across servers
        per_flow = [bytes_per_server([p for p in parts if p.server == j], len(shares))[j] / lanes[j]
                    for j in range(len(shares)) if shares[j] > 0]
        assert max(per_flow) / min(per_flow) < 1.6
