"""The cost model against hand-computed small cases."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hetrain.errors import UserError
from hetrain.perf.pipeline import (CostParams, Workload, evaluate, min_instances, run_cost,
                                   score_assignments, stage_tables, stage_throughput, stages_of)

from .conftest import random_workload


def one_layer(t=1e-3, pd=0.0, ps=0.0, act=0.0, price=1.0, count=100, mem=1e12, bw=1e9):
    return Workload(compute=np.array([[t]]), act_bytes=np.array([act]), dense_param_bytes=np.array([pd]),
                    sparse_param_bytes=np.array([ps]), price=np.array([price]), count=np.array([count]),
                    memory=np.array([mem]), bandwidth=np.array([bw]))


def test_compute_bound_stage_needs_ceil_of_target_over_rate():
    # 1 ms/sample -> 1000 samples/s per instance; 2500 samples/s needs 3 instances
    w = one_layer(t=1e-3, price=2.0)
    s = evaluate(w, [0], 2500.0, CostParams(batch_size=100))
    assert s.feasible
    assert s.stages[0].instances == 3
    assert s.throughput == pytest.approx(3000.0)
    assert s.hourly == pytest.approx(6.0)


def test_allreduce_makes_k_larger_by_hand():
    # B=100, T=1ms, P=1e7 bytes, bw=1e9: thr(k) = 100k / (0.1 + 2(k-1)·0.01)
    # thr(3) = 300/0.14 = 2142.9, thr(4) = 400/0.16 = 2500 exactly -> k = 4
    p = CostParams(batch_size=100)
    k = min_instances(1e-3, 1e7, 0.0, 0.0, 1e9, 1e12, 100, 2500.0, p)
    assert float(k) == 4
    assert stage_throughput(1e-3, 1e7, 1e9, 4, p) == pytest.approx(2500.0)
    assert stage_throughput(1e-3, 1e7, 1e9, 3, p) == pytest.approx(300 / 0.14)


def test_sync_bound_stage_cannot_scale():
    # P=1e8: thr(1)=1000, thr(2)=200/(0.1+0.2)=666.7: more instances only slow it down
    p = CostParams(batch_size=100)
    assert float(min_instances(1e-3, 1e8, 0.0, 0.0, 1e9, 1e12, 100, 900.0, p)) == 1
    assert np.isinf(min_instances(1e-3, 1e8, 0.0, 0.0, 1e9, 1e12, 100, 1200.0, p))


def test_sparse_tables_shard_over_instances_for_memory():
    # 10 GB of table x 2 (Adagrad) over 8 GB instances -> at least 3 instances
    p = CostParams(batch_size=1)
    k = min_instances(1e-6, 0.0, 1e10, 0.0, 1e9, 8e9, 100, 1.0, p)
    assert float(k) == 3
    assert np.isinf(min_instances(1e-6, 0.0, 1e10, 0.0, 1e9, 8e9, 2, 1.0, p))   # only 2 available
    # dense state that alone exceeds memory can never fit
    assert np.isinf(min_instances(1e-6, 3e9, 0.0, 0.0, 1e9, 8e9, 100, 1.0, p))


def test_two_stage_transfer_by_hand():
    # layer 0 on type 0, layer 1 on type 1; 1e6 bytes/sample cross the cut at 1e9 B/s:
    # each stage adds 1 ms (activations one way, gradients the other, full duplex)
    w = Workload(compute=np.array([[1e-3, 9.0], [9.0, 2e-3]]), act_bytes=np.array([1e6, 5.0]),
                 dense_param_bytes=np.zeros(2), sparse_param_bytes=np.zeros(2), price=np.array([1.0, 3.0]),
                 count=np.array([10, 10]), memory=np.array([1e12, 1e12]), bandwidth=np.array([1e9, 1e9]))
    s = evaluate(w, [0, 1], 400.0, CostParams(batch_size=10))
    assert s.stages[0].time_per_sample == pytest.approx(2e-3)
    assert s.stages[1].time_per_sample == pytest.approx(3e-3)
    assert [st.instances for st in s.stages] == [1, 2]      # 500/s and 2 x 333/s
    assert s.throughput == pytest.approx(500.0)
    assert s.hourly == pytest.approx(1.0 + 6.0)
    # same model on one type: no transfer at all (model input and output are free)
    s1 = evaluate(w, [0, 0], 1.0, CostParams(batch_size=10))
    assert s1.stages[0].time_per_sample == pytest.approx(9.001)


def test_run_cost_and_stage_runs():
    assert run_cost(10.0, 3.6e6, 1000.0) == pytest.approx(10.0)   # 3600 s at $10/h
    assert stages_of([2, 2, 0, 0, 0, 2]) == [(0, 2, 2), (2, 5, 0), (5, 6, 2)]


def test_total_availability_is_enforced():
    w = Workload(compute=np.array([[1e-3], [1e-3], [1e-3]]), act_bytes=np.array([10.0, 10.0, 10.0]),
                 dense_param_bytes=np.zeros(3), sparse_param_bytes=np.zeros(3), price=np.array([1.0]),
                 count=np.array([4]), memory=np.array([1e12]), bandwidth=np.array([1e9]))
    s = evaluate(w, [0, 0, 0], 1000.0)          # 3 ms/sample: needs 3+ instances: fits
    assert s.feasible and s.used == (3,)
    s = evaluate(w, [0, 0, 0], 1400.0)          # needs 5 > 4
    assert not s.feasible and "cannot reach the target" in s.reason


def test_two_stages_of_one_type_share_its_count():
    w = Workload(compute=np.array([[3e-3, 1.0], [1.0, 1e-4], [3e-3, 1.0]]), act_bytes=np.zeros(3),
                 dense_param_bytes=np.zeros(3), sparse_param_bytes=np.zeros(3), price=np.array([1.0, 1.0]),
                 count=np.array([4, 4]), memory=np.array([1e12, 1e12]), bandwidth=np.array([1e9, 1e9]))
    s = evaluate(w, [0, 1, 0], 1000.0)          # 3 + 3 instances of type 0, only 4
    assert [st.instances for st in s.stages] == [3, 1, 3]
    assert not s.feasible and "only 4 available" in s.reason
    assert np.isinf(s.hourly)
    hourly, viol = score_assignments(stage_tables(w, 1000.0), w, np.array([[0, 1, 0]]))
    assert np.isinf(hourly[0]) and viol[0] == pytest.approx(0.5)   # (6 - 4) / 4


def test_bad_inputs_raise():
    with pytest.raises(UserError, match="shape"):
        Workload(compute=np.ones((2, 1)), act_bytes=np.ones(3), dense_param_bytes=np.ones(2),
                 sparse_param_bytes=np.ones(2), price=np.ones(1), count=np.ones(1), memory=np.ones(1),
                 bandwidth=np.ones(1))
    with pytest.raises(UserError, match="target"):
        stage_tables(one_layer(), 0.0)
    with pytest.raises(UserError, match="batch_size"):
        CostParams(batch_size=0)
    with pytest.raises(UserError, match="entries"):
        evaluate(one_layer(), [0, 0], 1.0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), L=st.integers(1, 7), R=st.integers(1, 3),
       tfrac=st.floats(0.05, 3.0), tight=st.booleans())
def test_batched_scoring_matches_evaluate(seed, L, R, tfrac, tight):
    rng = np.random.default_rng(seed)
    w = random_workload(rng, L, R, tight)
    target = tfrac * 1000.0
    tables = stage_tables(w, target)
    A = rng.integers(0, R, size=(16, L))
    hourly, viol = score_assignments(tables, w, A)
    for a, h, v in zip(A, hourly, viol):
        s = evaluate(w, a, target)
        assert s.feasible == (v == 0)
        if s.feasible:
            assert h == pytest.approx(s.hourly)
            assert s.throughput >= target * (1 - 1e-9)
            assert all(st.memory <= w.memory[st.rtype] * (1 + 1e-9) for st in s.stages)
