from pathlib import Path

import pytest

from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.patterns import make_pattern, pattern_names
from hetrain.sched.trace import TraceError, load_trace, parse_trace_lines

GOOD = "A3C\tcmd\t-n\t1\t1000\t5.5\t1\n"


def test_real_trace_parses(gavel_dir):
    c = parse_cluster_spec("300:300:300")
    jobs = load_trace(gavel_dir / "traces" / "23dbec.trace", c)
    lines = [l for l in (gavel_dir / "traces" / "23dbec.trace").read_text().splitlines() if l.strip()]
    assert len(jobs) == len(lines)
    first = lines[0].split("\t")
    assert jobs[0].name == first[0] and jobs[0].work == int(first[4]) and jobs[0].requested == int(first[6])
    assert all(j.rates[:, 1].max() > 0 for j in jobs)


@pytest.mark.parametrize("line,msg", [
    ("A3C\tcmd\t-n\t1\t1000\t5.5\n", "expected 7 tab-separated fields"),
    ("Nope\tcmd\t-n\t1\t1000\t5.5\t1\n", "unknown job type 'Nope'"),
    ("A3C\tcmd\t-n\t1\tlots\t5.5\t1\n", "total steps 'lots' is not an integer"),
    ("A3C\tcmd\t-n\t1\t-4\t5.5\t1\n", "total steps must be > 0"),
    ("A3C\tcmd\t-n\t1\t1000\tsoon\t1\n", "arrival time 'soon'"),
    ("A3C\tcmd\t-n\t1\t1000\t-1\t1\n", "arrival time must be"),
    ("A3C\tcmd\t-n\t1\t1000\t5\t0\n", "GPU count must be >= 1"),
    ("A3C\tcmd\t-n\t1\t1000\t5\t16\n", "asks for 16 GPUs but the largest GPU pool"),
])
def test_bad_lines_name_their_line(gavel_dir, hetero, line, msg):
    with pytest.raises(TraceError) as err:
        parse_trace_lines([GOOD, "\n", line], hetero, source="t.trace")
    assert "t.trace:3:" in str(err.value) and msg in str(err.value)


def test_missing_and_empty_trace(gavel_dir, hetero, tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "none.trace", hetero)
    (tmp_path / "e.trace").write_text("\n# nothing\n")
    with pytest.raises(TraceError, match="no jobs"):
        load_trace(tmp_path / "e.trace", hetero)


def test_patterns_are_deterministic_and_shaped(gavel_dir, hetero):
    assert "poisson" in pattern_names()
    a = make_pattern("poisson", 30, hetero, seed=3)
    b = make_pattern("poisson", 30, hetero, seed=3)
    assert [j.arrival for j in a] == [j.arrival for j in b] and [j.work for j in a] == [j.work for j in b]
    assert all(j.arrival == 0 for j in make_pattern("all-at-once", 10, hetero))
    arr = sorted(j.arrival for j in make_pattern("bursts", 40, hetero, seed=1))
    assert len(set(arr)) < 40  # jobs share arrival instants
    assert all(j.requested <= hetero.largest_pool for j in a)


def test_shipped_data_is_inside_the_package(hetero, monkeypatch):
    """The throughputs and the benchmark's traces ship with the package, nameable by trace id."""
    from hetrain.sched.gavel import BUNDLED, bundled_traces, default_data_dir

    import hetrain
    monkeypatch.delenv("HETRAIN_GAVEL_DATA", raising=False)
    assert BUNDLED.is_relative_to(Path(hetrain.__file__).parent) and default_data_dir() == BUNDLED
    assert {"23dbec", "51b7ef", "0e4a51", "6214e9"} <= set(bundled_traces())
    assert (BUNDLED / "LICENSE").read_text().startswith("MIT License")
    jobs = load_trace("6214e9", hetero, limit=100)
    assert len(jobs) == 100
    with pytest.raises(TraceError, match="6214e9"):
        load_trace("no-such-trace", hetero)
