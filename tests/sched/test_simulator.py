import numpy as np
import pytest

from hetrain.cli import main
from hetrain.perf.jobs import TableCurve
from hetrain.sched.cluster import gpu_pools
from hetrain.sched.job import make_job
from hetrain.sched.patterns import make_pattern
from hetrain.sched.simulator import simulate

LIN = TableCurve({"v100": {g: float(g) for g in range(1, 9)}})


def test_single_job_runs_at_its_rate():
    c = gpu_pools(("v100",), (4,))
    r = simulate([make_job(0, "a", 5.0, 100.0, LIN, c, requested=2)], c, "fifo")
    assert r.finish[0] == pytest.approx(5.0 + 50.0) and r.restarts == 0
    r = simulate([make_job(0, "a", 5.0, 100.0, LIN, c, requested=2)], c, "doubling")
    assert r.finish[0] == pytest.approx(5.0 + 25.0)


def test_restart_cost_is_charged_on_resize():
    c = gpu_pools(("v100",), (2,))
    jobs = [make_job(0, "a", 0.0, 100.0, LIN, c, max_gpus=2, restart_cost=7.0),
            make_job(1, "b", 10.0, 10.0, LIN, c, max_gpus=2, restart_cost=7.0)]
    r = simulate(jobs, c, "doubling")
    # a runs on 2 GPUs for 10 s (20 done), shrinks to 1 (pays 7 s), b runs 10 s on 1 GPU
    # and ends at 20; a then grows back to 2 and pays 7 s again.
    assert r.finish[1] == pytest.approx(20.0)
    done_by_20 = 20 + (20 - 17) * 1
    assert r.finish[0] == pytest.approx(20 + 7 + (100 - done_by_20) / 2)
    assert r.restarts_per_job.tolist() == [2, 0]


@pytest.mark.parametrize("policy", ["fifo", "srtf", "doubling", "optimal", "adaptive", "gavel"])
def test_all_jobs_finish_and_metrics_are_sane(gavel_dir, hetero, policy):
    jobs = make_pattern("poisson", 15, hetero, seed=1)
    r = simulate(jobs, hetero, policy)
    assert np.all(np.isfinite(r.finish)) and np.all(r.finish >= r.start) and np.all(r.start >= r.arrival)
    assert 0 < r.utilization <= 1 + 1e-9
    assert r.p99_jct_s >= r.avg_jct_s > 0
    assert np.all(r.timeline_used <= np.array(hetero.counts))
    # nobody finishes faster than alone on the fastest allowed allocation
    for j, f in zip(jobs, r.finish):
        assert f - j.arrival >= j.work / j.rates.max() - 1e-6


def test_cli_simulate_writes_plots(gavel_dir, tmp_path, capsys):
    rc = main(["schedule", "simulate", "--pattern", "bursts", "--jobs", "12", "--cluster", "v100:4,k80:4",
               "--policy", "fifo,doubling", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "doubling" in out and "fifo" in out
    for f in ("jct_cdf.png", "timeline_fifo.png", "timeline_doubling.png", "summary.json"):
        assert (tmp_path / f).stat().st_size > 0


def test_cli_reports_bad_trace_line(gavel_dir, tmp_path, capsys):
    t = tmp_path / "x.trace"
    t.write_text("A3C\tc\t-n\t1\t100\t0\t1\nA3C\tc\t-n\t1\t100\t0\t64\n")
    rc = main(["schedule", "simulate", "--trace", str(t), "--cluster", "v100:8", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{t}:2:" in err and "64 GPUs" in err and "Traceback" not in err


def test_cli_bad_cluster_and_policy(capsys):
    assert main(["schedule", "simulate", "--pattern", "poisson", "--cluster", "v100=8"]) == 2
    assert "TYPE:COUNT" in capsys.readouterr().err
    assert main(["schedule", "simulate", "--pattern", "poisson", "--policy", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err


def test_cli_run_on_ray_needs_an_address(capsys):
    assert main(["schedule", "run", "--backend", "ray"]) == 2
    assert "--address" in capsys.readouterr().err
