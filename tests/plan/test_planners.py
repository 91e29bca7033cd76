"""Planner interface, baselines and the RL scheduler (correctness, not speed)."""
import numpy as np
import pytest

from hetrain.errors import UserError
from hetrain.plan.base import Problem
from hetrain.plan.planners import get_planner, planner_names
from hetrain.plan.rl import RLPlanner, layer_features

from .conftest import random_workload


def test_registry_lists_every_planner():
    assert {"rl", "exact", "greedy", "genetic", "gpu", "cpu"} <= set(planner_names())
    with pytest.raises(UserError, match="unknown planner"):
        get_planner("nope")


def test_uniform_baselines_pick_the_cheapest_type_of_their_kind():
    w = random_workload(np.random.default_rng(0), 4, 4)
    problem = Problem(w, 10.0)
    gpu = get_planner("gpu").plan(problem)
    cpu = get_planner("cpu").plan(problem)
    gpus = [r for r in range(4) if w.type_kinds[r] == "gpu"]
    cpus = [r for r in range(4) if w.type_kinds[r] == "cpu"]
    assert set(gpu.score.assignment) == {min(gpus, key=lambda r: w.price[r])}
    assert set(cpu.score.assignment) == {min(cpus, key=lambda r: w.price[r])}


def test_rl_is_seeded_and_reproducible():
    w = random_workload(np.random.default_rng(5), 10, 3)
    problem = Problem(w, 600.0)
    a = RLPlanner(updates=60, restarts=1, seed=1, progress=False).plan(problem)
    b = RLPlanner(updates=60, restarts=1, seed=1, progress=False).plan(problem)
    assert a.score.assignment == b.score.assignment
    assert a.info["updates"] == b.info["updates"]


def _ratios(rng, n, **kw):
    ratios = []
    for _ in range(n):
        w = random_workload(rng, 8, 3)
        problem = Problem(w, 500.0)
        ex = get_planner("exact").plan(problem)
        if not ex.feasible:
            continue
        r = RLPlanner(progress=False, **kw).plan(problem)
        assert r.feasible
        ratios.append(r.score.hourly / ex.score.hourly)
    return ratios


def test_rl_planner_within_5_percent_of_exact_on_small_models():
    ratios = _ratios(np.random.default_rng(7), 3, updates=200, restarts=1)
    assert ratios and max(ratios) <= 1.05


def test_pure_reinforce_learns_close_to_optimal():
    """REINFORCE alone (no local polish, no elite replay) on small random instances."""
    ratios = _ratios(np.random.default_rng(7), 3, updates=200, restarts=1, polish=False, replay=False)
    assert ratios and max(ratios) <= 1.10


def test_rl_features_are_finite():
    w = random_workload(np.random.default_rng(1), 6, 3, tight=True)
    f = layer_features(Problem(w, 5000.0))
    assert f.shape[0] == 6 and np.all(np.isfinite(f))


def test_bad_problem_inputs():
    w = random_workload(np.random.default_rng(0), 3, 2)
    with pytest.raises(UserError, match="target"):
        Problem(w, -1.0)
    with pytest.raises(UserError, match="samples"):
        Problem(w, 1.0, n_samples=0)
