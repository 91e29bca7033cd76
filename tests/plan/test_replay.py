"""Planner results replayed on saved layer profiles: bench/plan.py keeps the profiles a
run used in its JSON and `--profiles FILE` plans on them again; the RL planner is
held to 5% of exact on a saved set, and `realign` (the boundary placement RL's local
improvement ends with) is checked against exact."""
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hetrain.perf.pipeline import score_assignments
from hetrain.plan.base import Problem
from hetrain.plan.planners import get_planner
from hetrain.plan.baselines import realign
from hetrain.plan.catalogue import load_catalogue
from hetrain.plan.exact import max_throughput
from hetrain.plan.profile import ModelProfile

from .conftest import random_workload

FIXTURE = Path(__file__).parent / "fixtures" / "plan_profiles.json"
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))


def test_bench_replays_the_profiles_its_json_kept(tmp_path):
    from plan import profiles  # bench/plan.py

    got = profiles(["cnn", "ctr"], FIXTURE, quick=True)
    kept = json.loads(FIXTURE.read_text())["profiles"]
    assert got["cnn"] == ModelProfile.model_validate(kept["cnn"])
    assert got["ctr"].model_dump(mode="json") == ModelProfile.model_validate(kept["ctr"]).model_dump(mode="json")
    with pytest.raises(SystemExit, match="no profiles of \\['transformer200'\\]"):
        profiles(["transformer200"], FIXTURE, quick=True)
    with pytest.raises(SystemExit, match="no such file"):
        profiles(["cnn"], tmp_path / "missing.json", quick=True)


def _shifted(a: np.ndarray, rng) -> np.ndarray:
    """`a` with every other stage boundary moved by one layer where both stages keep a layer."""
    c = a.copy()
    bounds = np.flatnonzero(np.diff(a)) + 1
    edges = np.concatenate([[0], bounds, [len(a)]])
    for i, b in enumerate(bounds):
        if i % 2:  # every other boundary: a stage loses at most one layer
            continue
        left, right = b - edges[i], edges[i + 2] - b
        if rng.integers(2) and left > 1:
            c[b - 1] = a[b]       # the right stage grows left
        elif right > 1:
            c[b] = a[b - 1]       # the left stage grows right
    return c


@pytest.mark.parametrize("seed", range(4))
def test_realign_places_the_boundaries_of_a_type_sequence_as_exact_does(seed):
    """Exact's plan with its boundaries moved: realigned, it is priced as exact's again
    where the counts leave room (the type sequence is exact's); with binding counts it is
    never below exact and never dearer than its start."""
    rng = np.random.default_rng(seed)
    moved = 0
    for _ in range(12):
        w = random_workload(rng, 24, 3)
        for roomy in (False, True):
            if roomy:  # counts that never bind: the boundaries alone decide the price
                w = replace(w, count=np.full(w.n_types, 1e6))
            problem = Problem(w, 400.0)
            ex = get_planner("exact").plan(problem)
            if not ex.feasible:
                continue
            a = np.array(ex.score.assignment)
            c = _shifted(a, rng)
            start = score_assignments(problem.tables, w, c[None])[0][0]
            r, h = realign(problem.tables, w, c)
            assert h <= start and h == score_assignments(problem.tables, w, r[None])[0][0]
            assert h >= ex.score.hourly * (1 - 1e-9)
            if roomy:
                assert h == pytest.approx(ex.score.hourly, rel=1e-9)
                moved += start > ex.score.hourly * (1 + 1e-9)
    assert moved >= 2


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ctr", "cnn", "transformer"])
def test_rl_within_5_percent_of_exact_on_saved_profiles(model):
    prof = ModelProfile.model_validate(json.loads(FIXTURE.read_text())["profiles"][model])
    base = Problem(prof.workload(load_catalogue("aws")), 1.0)
    best, _ = max_throughput(base)
    for frac in (0.1, 0.4, 0.8):
        problem = base.with_target(best * frac)
        ex = get_planner("exact").plan(problem)
        rl = get_planner("rl", progress=False, seed=0).plan(problem)
        assert ex.feasible and rl.feasible
        assert rl.score.hourly <= 1.05 * ex.score.hourly, (model, frac, rl.score.hourly / ex.score.hourly)
