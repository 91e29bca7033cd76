"""No solver line reaches stdout from the scheduler's policies: HiGHS's C-level prints
are caught at file descriptor 1 (`hetrain.quiet`; tests/test_quiet.py tests the silencer
and the other HiGHS callers). SciPy's HiGHS entry points are made to print such a line
from the descriptor, as the C library does, on every call."""
import os

import pytest
import scipy.optimize

from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.patterns import make_pattern
from hetrain.sched.simulator import simulate


@pytest.fixture
def loud_highs(monkeypatch):
    calls = []
    for name in ("linprog", "milp"):
        real = getattr(scipy.optimize, name)

        def loud(*args, _real=real, **kwargs):
            calls.append(1)
            os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
            return _real(*args, **kwargs)

        monkeypatch.setattr(scipy.optimize, name, loud)
    return calls


def test_solver_policies_print_nothing(loud_highs, capfd):
    cluster = parse_cluster_spec("v100:2,p100:2,k80:2")
    for pol in ("goodput", "sia", "gavel", "optimal"):
        simulate(make_pattern("bursts", 12, cluster, seed=1), cluster, pol)
    out = capfd.readouterr().out
    assert loud_highs, "no policy called HiGHS: the test checks nothing"
    assert out == "", f"solver output reached stdout: {out[:200]!r}"
