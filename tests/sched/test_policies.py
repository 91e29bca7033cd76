import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.perf.jobs import TableCurve
from hetrain.sched.cluster import gpu_pools
from hetrain.sched.job import Alloc, make_job
from hetrain.sched.policies import check_allocation, get_policy, policy_names
from hetrain.sched.policies.doubling import doubling
from hetrain.sched.policies.optimal import exhaustive, objective, solve_milp

TYPES = ("v100", "k80")


@st.composite
def instances(draw, max_jobs=4):
    counts = tuple(draw(st.integers(1, 4)) for _ in TYPES)
    cluster = gpu_pools(TYPES, counts)
    njobs = draw(st.integers(1, max_jobs))
    jobs, alloc = [], {}
    for i in range(njobs):
        rates = {}
        for t in TYPES:
            r1 = draw(st.floats(0.5, 10))
            effs = [draw(st.floats(0.3, 1.0)) for _ in range(3)]
            rates[t] = {1: r1, 2: 2 * r1 * effs[0], 3: 3 * r1 * effs[1], 4: 4 * r1 * effs[2]}
        job = make_job(i, f"j{i}", 0.0, draw(st.floats(10, 1e4)), TableCurve(rates), cluster,
                       requested=draw(st.integers(1, max(counts))), restart_cost=draw(st.floats(0, 50)))
        job.started = draw(st.booleans())
        jobs.append(job)
    return cluster, jobs, alloc


@settings(max_examples=60, deadline=None)
@given(instances())
def test_every_policy_respects_capacity_and_bounds(inst):
    cluster, jobs, alloc = inst
    for name in policy_names():
        out = get_policy(name)(jobs, cluster, alloc, 0.0)
        check_allocation(jobs, cluster, out)  # raises on any violation
        used = np.zeros(len(TYPES), dtype=int)
        for a in out.values():
            used[a.type] += a.n
        assert np.all(used <= cluster.capacity)


@settings(max_examples=40, deadline=None)
@given(instances(max_jobs=3))
def test_milp_matches_exhaustive_and_bounds_doubling(inst):
    cluster, jobs, alloc = inst
    milp, brute = solve_milp(jobs, cluster, alloc), exhaustive(jobs, cluster, alloc)
    assert set(milp) == set(brute)
    o_milp, o_brute = objective(jobs, alloc, milp), objective(jobs, alloc, brute)
    assert o_milp == pytest.approx(o_brute, rel=1e-6)
    dbl = doubling(jobs, cluster, alloc, 0.0)
    assert set(dbl) == set(milp)  # same admitted jobs
    assert objective(jobs, alloc, dbl) >= o_milp * (1 - 1e-9)


def _linear_job(i, work, cluster, rate=1.0, maxg=8, restart=0.0):
    return make_job(i, f"j{i}", 0.0, work, TableCurve({"v100": {g: rate * g for g in range(1, maxg + 1)}}),
                    cluster, max_gpus=maxg, restart_cost=restart)


def test_doubling_spreads_gpus_by_gain():
    c = gpu_pools(("v100",), (8,))
    jobs = [_linear_job(0, 1000, c), _linear_job(1, 1000, c)]
    out = doubling(jobs, c, {}, 0.0)
    assert out == {0: Alloc(0, 4), 1: Alloc(0, 4)}
    # a long job gains more seconds per GPU than a short one
    jobs = [_linear_job(0, 10000, c), _linear_job(1, 100, c)]
    out = doubling(jobs, c, {}, 0.0)
    assert out[0].n > out[1].n and sum(a.n for a in out.values()) == 8


def test_doubling_keeps_running_size_when_restart_does_not_pay():
    c = gpu_pools(("v100",), (8,))
    jobs = [_linear_job(0, 100, c, restart=1000.0)]
    jobs[0].started = True
    assert doubling(jobs, c, {0: Alloc(0, 1)}, 0.0) == {0: Alloc(0, 1)}
    jobs[0].restart_cost = 0.0
    assert doubling(jobs, c, {0: Alloc(0, 1)}, 0.0) == {0: Alloc(0, 8)}


def test_fifo_blocks_at_head_and_gives_requests():
    c = gpu_pools(("v100",), (4,))
    curve = TableCurve({"v100": {1: 1.0, 2: 2.0, 4: 4.0}})
    jobs = [make_job(0, "a", 0, 10, curve, c, requested=2), make_job(1, "b", 1, 10, curve, c, requested=4),
            make_job(2, "c", 2, 1, curve, c, requested=1)]
    out = get_policy("fifo")(jobs, c, {}, 0.0)
    assert out == {0: Alloc(0, 2)}  # b does not fit and c waits behind it
    srtf = get_policy("srtf")(jobs, c, {}, 0.0)
    # c is shortest, b (4 GPUs) does not fit next to it and is skipped, a backfills
    assert srtf == {2: Alloc(0, 1), 0: Alloc(0, 2)}


def test_heterogeneous_doubling_uses_the_fast_pool_for_scaling_jobs():
    c = gpu_pools(("v100", "p100"), (8, 8))
    # faster on one p100, much faster on eight v100s (like Gavel's ResNet-18)
    curve = TableCurve({"v100": {1: 32.0, 2: 100.0, 4: 124.0, 8: 383.0}, "p100": {1: 36.0, 2: 61.0, 4: 94.0, 8: 130.0}})
    jobs = [make_job(0, "r", 0, 1e6, curve, c)]
    assert doubling(jobs, c, {}, 0.0) == {0: Alloc(0, 8)}


def test_unknown_policy():
    from hetrain.errors import UserError
    with pytest.raises(UserError, match="unknown policy"):
        get_policy("lottery")


@settings(max_examples=40, deadline=None)
@given(instances(max_jobs=3))
def test_adaptive_admits_like_optimal_srpt_and_never_beats_it(inst):
    from hetrain.sched.policies.adaptive import adaptive

    cluster, jobs, alloc = inst
    milp = solve_milp(jobs, cluster, alloc, order="srpt")
    out = adaptive(jobs, cluster, alloc, 0.0)
    check_allocation(jobs, cluster, out)
    assert set(out) == set(milp)  # same admitted jobs: the MILP is the optimum of the same decision
    assert objective(jobs, alloc, out) >= objective(jobs, alloc, milp) * (1 - 1e-9)


def _table_job(i, work, cluster, rates, **kw):
    return make_job(i, f"j{i}", 0.0, work, TableCurve(rates), cluster, **kw)


def test_adaptive_swaps_jobs_that_sit_on_each_others_better_type():
    c = gpu_pools(("v100", "p100"), (4, 4))
    # a is 3x faster on v100, b 3x faster on p100; both run on the wrong type now
    a = _table_job(0, 1e5, c, {"v100": {1: 3.0, 2: 6.0, 4: 12.0}, "p100": {1: 1.0, 2: 2.0, 4: 4.0}}, max_gpus=4,
                   restart_cost=1.0)
    b = _table_job(1, 1e5, c, {"v100": {1: 1.0, 2: 2.0, 4: 4.0}, "p100": {1: 3.0, 2: 6.0, 4: 12.0}}, max_gpus=4,
                   restart_cost=1.0)
    for j in (a, b):
        j.started = True
    now = {0: Alloc(1, 4), 1: Alloc(0, 4)}
    assert get_policy("adaptive")([a, b], c, now, 0.0) == {0: Alloc(0, 4), 1: Alloc(1, 4)}


def test_adaptive_moves_a_job_into_an_idle_pool():
    c = gpu_pools(("v100", "k80"), (4, 4))
    # both jobs run best on k80s, where doubling puts them, leaving the v100s idle
    short = _table_job(0, 100, c, {"v100": {1: 1.0, 2: 2.0, 4: 4.0}, "k80": {1: 4.0, 2: 8.0, 4: 16.0}}, max_gpus=4)
    long = _table_job(1, 1000, c, {"v100": {1: 2.0, 2: 2.0, 4: 4.0}, "k80": {1: 3.0, 2: 3.0, 4: 6.0}}, max_gpus=4)
    dbl = doubling([short, long], c, {}, 0.0)
    assert {a.type for a in dbl.values()} == {1}
    out = get_policy("adaptive")([short, long], c, {}, 0.0)
    assert out == {0: Alloc(0, 4), 1: Alloc(1, 4)}
    assert objective([short, long], {}, out) < objective([short, long], {}, dbl) / 1.5


def test_adaptive_admits_shortest_first_when_the_cluster_is_full():
    c = gpu_pools(("v100",), (2,))
    lin = {"v100": {1: 1.0, 2: 2.0}}
    jobs = [_table_job(0, 1000, c, lin), _table_job(1, 900, c, lin), _table_job(2, 10, c, lin)]
    jobs[2].arrival = 5.0  # the short job arrives last
    assert set(doubling(jobs, c, {}, 5.0)) == {0, 1}                # arrival order
    assert set(get_policy("adaptive")(jobs, c, {}, 5.0)) == {1, 2}  # SRPT order


def test_gavel_shares_time_and_takes_turns_in_rounds():
    from hetrain.sched.policies.gavel import time_shares

    c = gpu_pools(("v100", "k80"), (2, 2))
    a = _table_job(0, 1e4, c, {"v100": {1: 10.0}, "k80": {1: 1.0}}, max_gpus=1)
    b = _table_job(1, 1e4, c, {"v100": {1: 5.0}, "k80": {1: 4.0}}, max_gpus=1)
    more = [_table_job(i, 1e4, c, {"v100": {1: 5.0}, "k80": {1: 4.0}}, max_gpus=1) for i in (2, 3, 4)]
    # a gains 10x from a v100, the others 1.25x
    x, sf = time_shares([a, b, *more], c)
    assert np.all(x.sum(axis=1) <= 1 + 1e-9) and np.all((x * sf[:, None]).sum(axis=0) <= np.array(c.counts) + 1e-9)
    assert np.all(x.sum(axis=1) > 0.1)              # max-min: every job gets a share of time
    assert x[0, 0] > x[0, 1] == 0                    # a is 10x faster on a v100: it runs only there
    # five jobs on four GPUs: rounds take turns, every job gets GPUs within a few rounds
    held = set()
    for r in range(6):
        out = get_policy("gavel")([a, b, *more], c, {}, 360.0 * (r + 1))
        check_allocation([a, b, *more], c, out)
        for jid, al in out.items():
            [a, b, *more][jid].service_s[al.type] += 360.0
        held |= set(out)
    assert held == {0, 1, 2, 3, 4}
