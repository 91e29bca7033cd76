"""Provably optimal placement for the cost model in `hetrain.perf.pipeline`.

A plan is a partition of the layer chain into stages (maximal runs, so adjacent stages
have different types), each with the smallest instance count meeting the target. Its
price is the sum of independent stage prices, so without the *total* availability of
each type the optimum is a shortest path over (boundary, type of the stage ending there):

    best[j, r] = min_{i<j} ( min_{r' != r} best[i, r'] + price(i, j, r) ),  best[0, .] = 0

(O(L²R) with the min/second-min trick). A stage's own count limit is already in
price(i, j, r). If the DP optimum also respects every type's total availability it is
optimal for the constrained problem (it is optimal for a relaxation). Otherwise the
same path problem is solved as a MILP with SciPy's HiGHS: a binary per stage (i, j, r),
flow conservation at boundaries, no two adjacent stages of one type, and Σ k·y <= count
per type — exact as well (HiGHS proves optimality within its MIP gap, set to 0).
"""
from __future__ import annotations

import numpy as np

from ..perf.pipeline import StageTables, Workload
from .base import Planner, Problem, register


def chain_dp(tables: StageTables) -> tuple[float, tuple[int, ...] | None]:
    """Cheapest price per hour over all plans, ignoring total availability."""
    H = tables.hourly
    L = H.shape[0] - 1
    R = H.shape[2]
    best = np.full((L + 1, R), np.inf)
    arg_i = np.zeros((L + 1, R), dtype=int)
    arg_r = np.full((L + 1, R), -1, dtype=int)
    # min and second min over types at each boundary, for "min over r' != r"
    m1 = np.full(L + 1, np.inf); a1 = np.full(L + 1, -1); m2 = np.full(L + 1, np.inf); a2 = np.full(L + 1, -1)
    m1[0] = m2[0] = 0.0
    for j in range(1, L + 1):
        i = np.arange(j)
        # prev[i, r] = m1[i] unless a1[i] == r, then m2[i]
        prev = np.where(a1[i, None] == np.arange(R)[None, :], m2[i, None], m1[i, None])
        prev_r = np.where(a1[i, None] == np.arange(R)[None, :], a2[i, None], a1[i, None])
        tot = prev + H[:j, j, :]
        k = np.argmin(tot, axis=0)
        best[j] = tot[k, np.arange(R)]
        arg_i[j] = k
        arg_r[j] = prev_r[k, np.arange(R)]
        order = np.argsort(best[j], kind="stable")
        m1[j], a1[j] = best[j, order[0]], order[0]
        if R > 1:
            m2[j], a2[j] = best[j, order[1]], order[1]
    r = int(np.argmin(best[L]))
    if not np.isfinite(best[L, r]):
        return np.inf, None
    value = float(best[L, r])
    assign = np.empty(L, dtype=int)
    j = L
    while j > 0:
        i = arg_i[j, r]
        assign[i:j] = r
        r, j = int(arg_r[j, r]), int(i)
    return value, tuple(int(x) for x in assign)


def chain_milp(tables: StageTables, w: Workload, time_limit: float = 60.0) -> tuple[float, tuple[int, ...] | None, str]:
    """The constrained problem (total availability per type) as a MILP on HiGHS."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    H, K = tables.hourly, tables.k
    L = H.shape[0] - 1
    R = H.shape[2]
    ii, jj, rr = np.nonzero(np.isfinite(H))
    n = len(ii)
    if n == 0:
        return np.inf, None, "no stage can meet the target"
    cost = H[ii, jj, rr]
    kk = K[ii, jj, rr]
    rows, cols, vals, lo, hi = [], [], [], [], []
    row = 0
    var = np.arange(n)
    # flow: boundary 0 out = 1; boundary L in = 1; interior in - out = 0
    for b in range(L + 1):
        out_v = var[ii == b]
        in_v = var[jj == b]
        rows += [row] * (len(out_v) + len(in_v)); cols += list(out_v) + list(in_v)
        vals += [1.0] * len(out_v) + [-1.0] * len(in_v)
        if b == 0:
            lo.append(1.0); hi.append(1.0)
        elif b == L:
            lo.append(-1.0); hi.append(-1.0)
        else:
            lo.append(0.0); hi.append(0.0)
        row += 1
    # alternation: at an interior boundary, a stage of type r may not both end and start
    for b in range(1, L):
        for r in range(R):
            v = var[((jj == b) | (ii == b)) & (rr == r)]
            if len(v):
                rows += [row] * len(v); cols += list(v); vals += [1.0] * len(v)
                lo.append(0.0); hi.append(1.0); row += 1
    # total availability per type
    for r in range(R):
        v = var[rr == r]
        if len(v):
            rows += [row] * len(v); cols += list(v); vals += list(kk[v])
            lo.append(0.0); hi.append(float(w.count[r])); row += 1
    A = coo_matrix((vals, (rows, cols)), shape=(row, n)).tocsr()
    scale = max(float(np.max(cost)), 1e-12)
    res = milp(cost / scale, constraints=LinearConstraint(A, lo, hi), integrality=np.ones(n),
               bounds=Bounds(0, 1), options={"time_limit": time_limit, "mip_rel_gap": 0.0, "disp": False})
    if res.x is None:
        return np.inf, None, f"HiGHS: {res.message}"
    y = np.round(res.x).astype(bool)
    assign = np.empty(L, dtype=int)
    for v in np.flatnonzero(y):
        assign[ii[v]:jj[v]] = rr[v]
    status = "optimal" if res.status == 0 else f"HiGHS status {res.status}: {res.message}"
    return float(cost[y].sum()), tuple(int(x) for x in assign), status


def solve_exact(problem: Problem, time_limit: float = 60.0) -> tuple[tuple[int, ...] | None, dict]:
    tables = problem.tables
    value, assign = chain_dp(tables)
    if assign is None:
        return None, {"reason": "no plan meets the target: some layer cannot reach it on any type "
                                "within the available counts and memory", "method": "dp"}
    score = problem.evaluate(assign)
    if score.feasible:
        return assign, {"method": "dp", "hourly": value}
    value, assign, status = chain_milp(tables, problem.workload, time_limit)
    info = {"method": "milp", "status": status, "hourly": value}
    if assign is None:
        info["reason"] = "no plan meets the target within the available instance counts"
    return assign, info


@register("exact")
class ExactPlanner(Planner):
    """Chain DP, with a HiGHS MILP when total availability binds: provably optimal."""

    def __init__(self, time_limit: float = 60.0):
        self.time_limit = time_limit

    def solve(self, problem: Problem):
        return solve_exact(problem, self.time_limit)


def max_throughput(problem: Problem, assignment=None, iters: int = 40) -> tuple[float, tuple[int, ...] | None]:
    """Highest target some plan (or the given fixed assignment) can sustain within the
    catalogue's counts and memory, by geometric bisection on feasibility."""
    def feasible(tau: float):
        p = problem.with_target(tau)
        if assignment is not None:
            return assignment if p.evaluate(assignment).feasible else None
        a, _ = solve_exact(p, time_limit=20.0)
        return a if a is not None and p.evaluate(a).feasible else None

    lo, hi = 1e-6, max(problem.target, 1.0)
    best = feasible(lo)
    if best is None:
        return 0.0, None
    while (a := feasible(hi)) is not None:
        lo, best, hi = hi, a, hi * 4.0
        if hi > 1e15:
            return lo, best
    for _ in range(iters):
        mid = float(np.sqrt(lo * hi))
        a = feasible(mid)
        if a is not None:
            lo, best = mid, a
        else:
            hi = mid
        if hi / lo < 1 + 1e-4:
            break
    return lo, best
