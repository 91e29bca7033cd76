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
from ..quiet import quiet_stdout
from .base import Planner, Problem


def _dp(H: np.ndarray):
    """Forward DP over boundaries; returns best (L+1, R), arg_i, arg_r."""
    L = H.shape[0] - 1
    R = H.shape[2]
    best = np.full((L + 1, R), np.inf)
    arg_i = np.zeros((L + 1, R), dtype=int)
    arg_r = np.full((L + 1, R), -1, dtype=int)
    # min and second min over types at each boundary, for "min over r' != r"
    m1 = np.full(L + 1, np.inf); a1 = np.full(L + 1, -1); m2 = np.full(L + 1, np.inf); a2 = np.full(L + 1, -1)
    m1[0] = m2[0] = 0.0
    types = np.arange(R)
    for j in range(1, L + 1):
        same = a1[:j, None] == types[None, :]
        prev = np.where(same, m2[:j, None], m1[:j, None])
        prev_r = np.where(same, a2[:j, None], a1[:j, None])
        tot = prev + H[:j, j, :]
        k = np.argmin(tot, axis=0)
        best[j] = tot[k, types]
        arg_i[j] = k
        arg_r[j] = prev_r[k, types]
        order = np.argsort(best[j], kind="stable")
        m1[j], a1[j] = best[j, order[0]], order[0]
        if R > 1:
            m2[j], a2[j] = best[j, order[1]], order[1]
    return best, arg_i, arg_r


def _path(best, arg_i, arg_r) -> tuple[float, tuple[int, ...] | None]:
    L = best.shape[0] - 1
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


def chain_dp(tables: StageTables, H: np.ndarray | None = None) -> tuple[float, tuple[int, ...] | None]:
    """Cheapest price per hour over all plans, ignoring total availability (or, with H,
    for another per-stage price table of the same shape)."""
    return _path(*_dp(tables.hourly if H is None else H))


def _other(best: np.ndarray) -> np.ndarray:
    """best_other[b, r] = min over r' != r of best[b, r'] (0 at an open end)."""
    R = best.shape[1]
    if R == 1:
        return np.full_like(best, np.inf)
    order = np.sort(best, axis=1)
    m1, m2 = order[:, 0], order[:, 1]
    arg = np.argmin(best, axis=1)
    return np.where(np.arange(R)[None, :] == arg[:, None], m2[:, None], m1[:, None])


def arc_bounds(H: np.ndarray) -> np.ndarray:
    """For every stage (i, j, r): the cheapest price of a whole plan that contains it
    (prefix before i and suffix after j both avoid type r next to it)."""
    L = H.shape[0] - 1
    fwd, _, _ = _dp(H)
    Hrev = H[::-1, ::-1, :].transpose(1, 0, 2)            # Hrev[a, b] = H[L-b, L-a]
    bwd_rev, _, _ = _dp(Hrev)
    bwd = bwd_rev[::-1]                                     # bwd[i, r]: layers i..L-1, first stage r
    pre = _other(fwd)
    pre[0] = 0.0
    suf = _other(bwd)
    suf[L] = 0.0
    return pre[:, None, :] + H + suf[None, :, :]


def lagrangian_bounds(tables: StageTables, w: Workload, problem, iters: int = 25):
    """Subgradient ascent on the Lagrangian dual of the total-count constraints.
    Returns (lower bound, per-arc bound array, best feasible plan met or None, its price)."""
    H, K = tables.hourly, np.where(np.isfinite(tables.k), tables.k, 0.0)
    lam = np.zeros(w.n_types)
    best_lb, best_lam = -np.inf, lam.copy()
    ub, ub_a = np.inf, None
    step = float(np.nanmean(w.price))
    for it in range(iters):
        Hl = H + lam[None, None, :] * K
        val, a = chain_dp(tables, Hl)
        if a is None:
            return np.inf, None, None, np.inf
        lb = val - float(lam @ w.count)
        if lb > best_lb:
            best_lb, best_lam = lb, lam.copy()
        s = problem.evaluate(a)
        used = np.array(s.used, dtype=float)
        if s.feasible and s.hourly < ub:
            ub, ub_a = s.hourly, a
        g = used - w.count
        if ub < np.inf and ub - best_lb <= 1e-9 * max(1.0, ub):
            break
        if np.all(g <= 0) and np.allclose(lam * g, 0):
            break
        lam = np.maximum(0.0, lam + step / (1 + it) * g / max(1.0, float(np.linalg.norm(g))))
    Hl = H + best_lam[None, None, :] * K
    bounds = arc_bounds(Hl) - float(best_lam @ w.count)
    return best_lb, bounds, ub_a, ub


def chain_milp(tables: StageTables, w: Workload, time_limit: float = 60.0,
               keep: np.ndarray | None = None) -> tuple[float, tuple[int, ...] | None, str]:
    """The constrained problem (total availability per type) as a MILP on HiGHS, over
    the stages where ``keep`` is true (default: all possible stages)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    H, K = tables.hourly, tables.k
    L = H.shape[0] - 1
    R = H.shape[2]
    ii, jj, rr = np.nonzero(np.isfinite(H) if keep is None else (np.isfinite(H) & keep))
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
    with quiet_stdout():  # HiGHS prints some lines from C whatever "disp" says
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


def capacity_dp(tables: StageTables, w: Workload, tracked: list[int]) -> tuple[float, tuple[int, ...] | None]:
    """Chain DP whose state also counts the instances used of each ``tracked`` type
    (0..count), so their total availability holds exactly; other types are unconstrained
    in total. State size S = prod(count_t + 1); work O(L² R S)."""
    H, K = tables.hourly, tables.k
    L, R = H.shape[0] - 1, H.shape[2]
    caps = [int(w.count[t]) for t in tracked]
    S = int(np.prod([c + 1 for c in caps])) if caps else 1
    strides = np.cumprod([1] + [c + 1 for c in caps[::-1]])[:-1][::-1] if caps else np.array([], int)
    cidx = np.arange(S)
    comp = {t: (cidx // strides[a]) % (caps[a] + 1) for a, t in enumerate(tracked)}
    stride_of = {t: int(strides[a]) for a, t in enumerate(tracked)}
    best = np.full((L + 1, R, S), np.inf)
    arg_i = np.zeros((L + 1, R, S), dtype=np.int32)
    arg_r = np.full((L + 1, R, S), -1, dtype=np.int32)
    arg_c = np.zeros((L + 1, R, S), dtype=np.int32)
    # other[b, r, c] = min over r' != r of best[b, r', c]; at b = 0 only c = 0 is reachable
    other = np.full((L + 1, R, S), np.inf)
    other_r = np.full((L + 1, R, S), -1, dtype=np.int32)
    other[0, :, 0] = 0.0
    types = np.arange(R)
    for j in range(1, L + 1):
        for r in range(R):
            h = H[:j, j, r]
            ok_i = np.flatnonzero(np.isfinite(h))
            if ok_i.size == 0:
                continue
            if r in stride_of:
                k = K[ok_i, j, r].astype(int)
                src = cidx[None, :] - k[:, None] * stride_of[r]
                valid = comp[r][None, :] >= k[:, None]
                src = np.where(valid, src, 0)
                vals = np.where(valid, other[ok_i[:, None], r, src], np.inf) + h[ok_i][:, None]
            else:
                src = np.broadcast_to(cidx[None, :], (ok_i.size, S))
                vals = other[ok_i, r, :] + h[ok_i][:, None]
            m = np.argmin(vals, axis=0)
            best[j, r] = vals[m, cidx]
            arg_i[j, r] = ok_i[m]
            arg_c[j, r] = src[m, cidx]
            arg_r[j, r] = other_r[ok_i[m], r, src[m, cidx]]
        if R > 1:
            order = np.argsort(best[j], axis=0, kind="stable")          # (R, S)
            m1, m2 = order[0], order[1]
            v1, v2 = best[j, m1, cidx], best[j, m2, cidx]
            same = types[:, None] == m1[None, :]
            other[j] = np.where(same, v2[None, :], v1[None, :])
            other_r[j] = np.where(same, m2[None, :], m1[None, :])
    end = best[L].reshape(-1)
    flat = int(np.argmin(end))
    if not np.isfinite(end[flat]):
        return np.inf, None
    r, c = divmod(flat, S)
    value = float(end[flat])
    assign = np.empty(L, dtype=int)
    j = L
    while j > 0:
        i = int(arg_i[j, r, c])
        assign[i:j] = r
        r, c, j = int(arg_r[j, r, c]), int(arg_c[j, r, c]), i
    return value, tuple(int(x) for x in assign)


def solve_exact(problem: Problem, time_limit: float = 60.0, max_states: int = 4096):
    """Exact minimum-price plan: relaxed chain DP; while its optimum over-uses some types,
    add them to the capacity-tracked set and re-solve (each solve is optimal for a
    relaxation, so the first feasible one is optimal). Past ``max_states`` capacity
    states, a MILP over the stages that Lagrangian bounds keep (also exact; HiGHS)."""
    tables = problem.tables
    w = problem.workload
    value, assign = chain_dp(tables)
    if assign is None:
        return None, {"reason": "no plan meets the target: some layer cannot reach it on any type "
                                "within the available counts and memory", "method": "dp"}
    tracked: list[int] = []
    while True:
        score = problem.evaluate(assign)
        if score.feasible:
            return assign, {"method": "dp" if not tracked else "capacity-dp", "hourly": value,
                            "tracked": [w.type_names[t] if w.type_names else t for t in tracked]}
        over = [t for t in range(w.n_types) if score.used[t] > w.count[t] and t not in tracked]
        if not over:  # pragma: no cover - a tracked type cannot be over-used
            raise RuntimeError("capacity DP returned a plan over a tracked type's count")
        tracked = sorted(tracked + over)
        if np.prod([w.count[t] + 1 for t in tracked]) > max_states:
            break
        value, assign = capacity_dp(tables, w, tracked)
        if assign is None:
            return None, {"reason": "no plan meets the target within the available instance counts",
                          "method": "capacity-dp"}
    return _solve_milp(problem, assign, time_limit)


def _solve_milp(problem: Problem, assign, time_limit: float):
    tables = problem.tables
    # total counts bind: Lagrangian bounds, then a MILP over the stages that can still
    # appear in a plan cheaper than the best feasible one found (an exact reduction)
    w = problem.workload
    lb, bounds, ub_a, ub = lagrangian_bounds(tables, w, problem)
    if bounds is None:
        return None, {"reason": "no plan meets the target", "method": "lagrangian"}
    if ub_a is None:
        # no feasible incumbent: local search on the relaxed optimum for one
        from .baselines import local_search
        cand = local_search(tables, w, assign, np.random.default_rng(0))
        s = problem.evaluate(cand)
        if s.feasible:
            ub_a, ub = tuple(int(x) for x in cand), s.hourly
    if ub_a is not None and ub - lb <= 1e-9 * max(1.0, ub):
        return ub_a, {"method": "lagrangian", "hourly": ub, "lower_bound": lb}
    keep = bounds <= ub * (1 + 1e-9) + 1e-12 if ub_a is not None else np.ones_like(bounds, dtype=bool)
    value, m_assign, status = chain_milp(tables, w, time_limit, keep)
    info = {"method": "milp", "status": status, "hourly": value, "lower_bound": lb,
            "arcs": int(np.count_nonzero(keep & np.isfinite(tables.hourly)))}
    if m_assign is not None and (ub_a is None or value < ub):
        return m_assign, info
    if ub_a is not None:
        info["hourly"] = ub
        return ub_a, info
    info["reason"] = "no plan meets the target within the available instance counts"
    return None, info


class ExactPlanner(Planner):
    """Chain DP, with a HiGHS MILP when total availability binds: provably optimal."""

    name = "exact"

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
