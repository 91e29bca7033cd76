"""No solver line reaches stdout: HiGHS's C-level prints are caught at file descriptor 1."""
import os

from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.patterns import make_pattern
from hetrain.sched.quiet import quiet_stdout
from hetrain.sched.simulator import simulate


def test_descriptor_one_is_silenced_and_restored(capfd):
    print("before", flush=True)
    with quiet_stdout():
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
    print("after", flush=True)
    out = capfd.readouterr().out
    assert "Highs" not in out
    assert out.splitlines() == ["before", "after"]


def test_solver_policies_print_nothing(capfd):
    cluster = parse_cluster_spec("v100:4,p100:4,k80:4")
    for pol in ("goodput", "sia", "gavel", "optimal"):
        simulate(make_pattern("bursts", 12, cluster, seed=1), cluster, pol)
    out = capfd.readouterr().out
    assert out == "", f"solver output reached stdout: {out[:200]!r}"
