"""No solver line reaches stdout: HiGHS prints some lines from C straight to file
descriptor 1 (``HighsMipSolverData::transformNewIntegerFeasibleSolution ...``) whatever
its display options say, so every call into it runs inside `hetrain.quiet.quiet_stdout`.
The tests make SciPy's HiGHS entry points print such a line from the descriptor, as the
C library does, and check that none reaches stdout while the result is unchanged."""
import os

import numpy as np
import pytest
import scipy.optimize

from hetrain.perf.comm import optimal_split
from hetrain.plan.base import Problem
from hetrain.plan.exact import chain_milp
from hetrain.quiet import quiet_stdout

from .plan.conftest import random_workload

LINE = b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n"


@pytest.fixture
def loud_highs(monkeypatch):
    """SciPy's linprog and milp, each first writing a HiGHS debug line to descriptor 1."""
    for name in ("linprog", "milp"):
        real = getattr(scipy.optimize, name)

        def loud(*args, _real=real, **kwargs):
            os.write(1, LINE)
            return _real(*args, **kwargs)

        monkeypatch.setattr(scipy.optimize, name, loud)


def test_descriptor_one_is_silenced_and_restored(capfd):
    print("before", flush=True)
    with quiet_stdout():
        os.write(1, LINE)
    print("after", flush=True)
    out = capfd.readouterr().out
    assert "Highs" not in out
    assert out.splitlines() == ["before", "after"]


def test_the_split_lp_prints_nothing(loud_highs, capfd):
    plan = optimal_split(8e6, np.array([10e9, 10e9, 25e9]), np.array([10e9]))
    assert plan.gpu_bytes.sum() + plan.cpu_bytes.sum() == pytest.approx(8e6)
    assert capfd.readouterr().out == ""


def test_the_planner_milp_prints_nothing(loud_highs, capfd):
    w = random_workload(np.random.default_rng(3), 4, 2, True)
    problem = Problem(w, 1000.0)
    value, _, status = chain_milp(problem.tables, w)
    assert status == "optimal" or not np.isfinite(value)
    assert capfd.readouterr().out == ""
