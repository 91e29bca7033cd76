"""The exact solver against brute force over every assignment (property-based)."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hetrain.perf.pipeline import CostParams, evaluate
from hetrain.plan.base import Problem
from hetrain.plan.planners import get_planner
from hetrain.plan.exact import chain_dp, chain_milp, max_throughput, solve_exact

from .conftest import random_workload


def brute_force(w, target, params=CostParams(), respect_counts=True):
    best = np.inf
    for a in itertools.product(range(w.n_types), repeat=w.n_layers):
        s = evaluate(w, a, target, params)
        if s.feasible:
            best = min(best, s.hourly)
        elif not respect_counts and all(st.instances > 0 for st in s.stages):
            best = min(best, sum(st.hourly for st in s.stages))
    return best


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), L=st.integers(1, 6), R=st.integers(1, 3),
       tfrac=st.floats(0.05, 4.0), tight=st.booleans())
def test_exact_equals_brute_force(seed, L, R, tfrac, tight):
    rng = np.random.default_rng(seed)
    w = random_workload(rng, L, R, tight)
    target = tfrac * 1000.0
    problem = Problem(w, target)
    a, info = solve_exact(problem)
    bf = brute_force(w, target)
    if np.isinf(bf):
        assert a is None or not problem.evaluate(a).feasible
    else:
        assert a is not None
        s = problem.evaluate(a)
        assert s.feasible
        assert s.hourly == pytest.approx(bf, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), L=st.integers(1, 5), R=st.integers(1, 3), tfrac=st.floats(0.1, 3.0))
def test_milp_alone_equals_brute_force(seed, L, R, tfrac):
    """The MILP path, used when availability couples stages, on tight counts."""
    rng = np.random.default_rng(seed)
    w = random_workload(rng, L, R, tight=True)
    problem = Problem(w, tfrac * 1000.0)
    value, a, status = chain_milp(problem.tables, w)
    bf = brute_force(w, problem.target)
    if np.isinf(bf):
        assert a is None or not problem.evaluate(a).feasible
    else:
        assert status == "optimal"
        assert problem.evaluate(a).hourly == pytest.approx(bf, rel=1e-9)
        assert value == pytest.approx(bf, rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), L=st.integers(1, 6), R=st.integers(1, 3), tfrac=st.floats(0.1, 3.0))
def test_dp_is_the_relaxation_without_total_counts(seed, L, R, tfrac):
    rng = np.random.default_rng(seed)
    w = random_workload(rng, L, R, tight=True)
    problem = Problem(w, tfrac * 1000.0)
    value, a = chain_dp(problem.tables)
    assert value == pytest.approx(brute_force(w, problem.target, respect_counts=False), rel=1e-9)


def test_exact_is_never_beaten_by_other_planners():
    rng = np.random.default_rng(3)
    for trial in range(4):
        w = random_workload(rng, 8, 3, tight=trial % 2 == 1)
        problem = Problem(w, 800.0)
        ex = get_planner("exact").plan(problem)
        for name in ("greedy", "gpu", "cpu", "genetic"):
            other = get_planner(name, **({"generations": 30} if name == "genetic" else {})).plan(problem)
            if other.feasible:
                assert ex.feasible
                assert ex.score.hourly <= other.score.hourly * (1 + 1e-12)


def test_max_throughput_is_the_feasibility_edge():
    rng = np.random.default_rng(11)
    w = random_workload(rng, 5, 2, tight=True)
    problem = Problem(w, 100.0)
    best, a = max_throughput(problem)
    assert best > 0 and a is not None
    assert problem.with_target(best).evaluate(a).feasible
    assert solve_exact(problem.with_target(best * 1.01))[0] is None or \
        not problem.with_target(best * 1.01).evaluate(solve_exact(problem.with_target(best * 1.01))[0]).feasible


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), L=st.integers(1, 5), R=st.integers(1, 3), tfrac=st.floats(0.1, 3.0))
def test_capacity_dp_tracking_every_type_equals_brute_force(seed, L, R, tfrac):
    from hetrain.plan.exact import capacity_dp

    rng = np.random.default_rng(seed)
    w = random_workload(rng, L, R, tight=True)
    problem = Problem(w, tfrac * 1000.0)
    value, a = capacity_dp(problem.tables, w, list(range(R)))
    bf = brute_force(w, problem.target)
    if np.isinf(bf):
        assert a is None
    else:
        assert problem.evaluate(a).feasible
        assert value == pytest.approx(bf, rel=1e-9)
