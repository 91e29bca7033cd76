"""The integer program every goodput-style policy solves at a decision: a
multiple-choice knapsack. Each job picks at most one column (a GPU type and count, with
a value); the columns picked on a type may not use more GPUs than it has:

    maximise sum_c x_c value_c   s.t.  sum_{c of job j} x_c <= 1,  sum_{c on type t} n_c x_c <= cap_t,  x binary

`choose` takes the cheapest route that is exact up to a certified gap (see there); the
certificate is always a Lagrangian bound: for any GPU prices lambda >= 0,
D(lambda) = sum_j max(0, max_c value_c - lambda_t(c) n_c) + sum_t lambda_t cap_t is an
upper bound on the optimum, so a plan within DECOMPOSE_GAP of some D(lambda) is within
that gap of the optimum. HiGHS (SciPy's `milp`, `linprog`) does the solving; the price
pass and the greedy repair below are hand-written because they are a few numpy lines
that let most decisions skip the solver's per-call overhead (tens of milliseconds) when
the previous decision's prices still certify the plan.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ...quiet import quiet_stdout

MIP_GAP = 1e-4  # relative optimality gap HiGHS stops at
OPEN_JOBS = 48  # jobs re-placed when the fractional ones alone are not enough
DECOMPOSE_GAP = 5e-3  # a plan within this of a Lagrangian bound is accepted
FULL_TIME_LIMIT_S = 5.0  # the full integer program's time limit (HiGHS keeps its best plan)
STATS = {"slack": 0, "priced": 0, "decomposed": 0, "widened": 0, "full": 0}  # how `choose` decided (benchmark)


@dataclass(frozen=True)
class Configs:
    """The integer program's columns: job index, type, count and value of each."""

    job: np.ndarray
    type: np.ndarray
    n: np.ndarray
    value: np.ndarray

    @classmethod
    def empty(cls) -> "Configs":
        """No column (no job, or no configuration that fits)."""
        e = np.zeros(0, dtype=np.int64)
        return cls(e, e, e, np.zeros(0))


def _milp(cfg: Configs, njobs: int, capacity: np.ndarray, time_limit: float | None = None,
          gap: float = MIP_GAP) -> np.ndarray:
    """HiGHS on the integer program over the columns of `cfg`; the chosen columns (bool)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    nv = len(cfg.value)
    cols = np.arange(nv)
    one = csr_array((np.ones(nv), (cfg.job, cols)), shape=(njobs, nv))
    cap = csr_array((cfg.n.astype(float), (cfg.type, cols)), shape=(len(capacity), nv))
    cons = [LinearConstraint(one, -np.inf, 1.0), LinearConstraint(cap, -np.inf, np.asarray(capacity, dtype=float))]
    scale = float(cfg.value.max())
    # the relaxation is nearly integral (a multiple-choice knapsack with one row per GPU
    # type): presolve costs more than it saves, and a 1e-4 relative gap ends the search
    options = {"mip_rel_gap": gap, "presolve": False}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    with quiet_stdout():
        res = milp(-cfg.value / scale, constraints=cons, integrality=np.ones(nv), bounds=Bounds(0, 1),
                   options=options)
    if res.x is None:  # pragma: no cover - x = 0 is always feasible
        raise RuntimeError(f"the goodput integer program failed: {res.message}")
    return res.x > 0.5


def _relaxation(cfg: Configs, njobs: int, capacity: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """The linear relaxation by HiGHS's dual simplex: (x, its objective, an upper bound on
    the integer program's; the capacity rows' prices per GPU, in objective units)."""
    from scipy.optimize import linprog
    from scipy.sparse import csr_array, vstack

    nv = len(cfg.value)
    cols = np.arange(nv)
    a = vstack([csr_array((np.ones(nv), (cfg.job, cols)), shape=(njobs, nv)),
                csr_array((cfg.n.astype(float), (cfg.type, cols)), shape=(len(capacity), nv))]).tocsr()
    b = np.concatenate([np.ones(njobs), np.asarray(capacity, dtype=float)])
    scale = float(cfg.value.max())
    with quiet_stdout():
        res = linprog(-cfg.value / scale, A_ub=a, b_ub=b, bounds=(0, 1), method="highs-ds")
    if res.x is None:  # pragma: no cover - x = 0 is always feasible
        raise RuntimeError(f"the goodput relaxation failed: {res.message}")
    price = -np.asarray(res.ineqlin.marginals[njobs:], dtype=float) * scale
    return res.x, float(cfg.value @ res.x), price


def _margins(cfg: Configs, njobs: int, price: np.ndarray) -> np.ndarray:
    """How firmly the relaxation settles each job: its best column's reduced value
    (value - GPUs x the type's price, or 0 for running nothing) minus its second best.
    A job with a small margin is the one a capacity change is likely to move."""
    red = cfg.value - price[cfg.type] * cfg.n
    first = np.zeros(njobs)      # running nothing is worth 0
    second = np.zeros(njobs)
    order = np.argsort(-red, kind="stable")
    seen = np.zeros(njobs, dtype=np.int64)
    for k in order.tolist():     # columns best first: each job's first two (plus "nothing" at 0)
        j = cfg.job[k]
        if seen[j] == 0:
            first[j] = max(red[k], 0.0)
            second[j] = min(red[k], 0.0) if red[k] > 0 else 0.0
        elif seen[j] == 1 and red[k] > second[j]:
            second[j] = red[k]
        seen[j] += 1
    return first - second


def _fix_and_place(cfg: Configs, njobs: int, cap: np.ndarray, x_lp: np.ndarray, open_jobs: np.ndarray) -> np.ndarray:
    """Keep the relaxation's whole choices of every job not in `open_jobs`, and place the
    open ones by a small integer program in the GPUs left."""
    open_mask = np.zeros(njobs, dtype=bool)
    open_mask[open_jobs] = True
    x = (x_lp > 1 - 1e-7) & ~open_mask[cfg.job]
    left = cap - np.bincount(cfg.type[x], weights=cfg.n[x], minlength=len(cap)).astype(np.int64)
    if len(open_jobs):
        sub = np.flatnonzero(open_mask[cfg.job])
        remap = np.full(njobs, -1)
        remap[open_jobs] = np.arange(len(open_jobs))
        sub_cfg = Configs(remap[cfg.job[sub]], cfg.type[sub], cfg.n[sub], cfg.value[sub])
        x[sub[_milp(sub_cfg, len(open_jobs), left)]] = True
    return x


@dataclass
class Prices:
    """The GPU prices (objective units per GPU of each type) of the last decision's
    relaxation: a policy's warm start. Between two decisions one job arrives or ends, so
    the old prices usually still certify the new plan and the solver is not called."""

    value: np.ndarray | None = field(default=None)


def _best_under(cfg: Configs, njobs: int, price: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, float]:
    """Each job's best column under GPU prices (-1: running nothing is better) and the
    Lagrangian bound D(price) (module docstring)."""
    red = cfg.value - price[cfg.type] * cfg.n
    order = np.lexsort((-red, cfg.job))
    first = order[np.concatenate([[True], cfg.job[order][1:] != cfg.job[order][:-1]])]
    pick = np.full(njobs, -1)
    good = red[first] > 0
    pick[cfg.job[first[good]]] = first[good]
    return pick, float(red[first[good]].sum() + price @ np.asarray(cap, dtype=float))


def _usage(cfg: Configs, pick: np.ndarray, ntypes: int) -> np.ndarray:
    on = pick[pick >= 0]
    return np.bincount(cfg.type[on], weights=cfg.n[on], minlength=ntypes).astype(np.int64)


def _repair_and_fill(cfg: Configs, pick: np.ndarray, cap: np.ndarray, max_moves: int | None = None) -> np.ndarray | None:
    """Make a plan fit (greedily move the jobs whose move loses least value per GPU freed
    off an overfull type) and then use GPUs left idle (greedily take the column that
    gains most and fits). None when it takes more than `max_moves` moves."""
    pick = pick.copy()
    used = _usage(cfg, pick, len(cap))
    if max_moves is None:  # enough to move every overflowing GPU and fill every idle one, one by one
        max_moves = 64 + int(np.abs(used - cap).sum())
    cur_v = np.where(pick >= 0, cfg.value[np.maximum(pick, 0)], 0.0)
    for _ in range(max_moves):
        over = np.flatnonzero(used > cap)
        if not len(over):
            break
        t = int(over[0])
        # columns that leave type t (or take fewer of it) and fit where they go
        own = pick[cfg.job]
        on_t = (own >= 0) & (cfg.type[np.maximum(own, 0)] == t)
        own_n = cfg.n[np.maximum(own, 0)]
        freed = np.where(cfg.type == t, own_n - cfg.n, own_n)
        room = np.where(cfg.type == t, True, cfg.n <= cap[cfg.type] - used[cfg.type])
        ok = on_t & (freed > 0) & room
        loss = (cur_v[cfg.job] - cfg.value) / np.maximum(freed, 1)
        # dropping a job altogether frees all its GPUs on t
        jobs_t = np.flatnonzero((pick >= 0) & (cfg.type[np.maximum(pick, 0)] == t))
        drop_loss = cur_v[jobs_t] / cfg.n[pick[jobs_t]]
        k_col = int(np.argmin(np.where(ok, loss, np.inf))) if ok.any() else -1
        k_drop = int(np.argmin(drop_loss))
        if k_col >= 0 and loss[k_col] <= drop_loss[k_drop]:
            j = int(cfg.job[k_col])
            used[t] -= int(freed[k_col]) if cfg.type[k_col] == t else int(own_n[k_col])
            if cfg.type[k_col] != t:
                used[cfg.type[k_col]] += int(cfg.n[k_col])
            pick[j], cur_v[j] = k_col, cfg.value[k_col]
        else:
            j = int(jobs_t[k_drop])
            used[t] -= int(cfg.n[pick[j]])
            pick[j], cur_v[j] = -1, 0.0
    else:
        return None
    for _ in range(max_moves):
        own = pick[cfg.job]
        same_t = (own >= 0) & (cfg.type[np.maximum(own, 0)] == cfg.type)
        extra = cfg.n - np.where(same_t, cfg.n[np.maximum(own, 0)], 0)
        fits = extra <= cap[cfg.type] - used[cfg.type]
        gain = np.where(fits, cfg.value - cur_v[cfg.job], 0.0)
        k = int(np.argmax(gain))
        if gain[k] <= 0:
            break
        j = int(cfg.job[k])
        if pick[j] >= 0:
            used[cfg.type[pick[j]]] -= int(cfg.n[pick[j]])
        used[cfg.type[k]] += int(cfg.n[k])
        pick[j], cur_v[j] = k, cfg.value[k]
    return pick if np.all(used <= cap) else None


def _priced(cfg: Configs, njobs: int, cap: np.ndarray, price: np.ndarray, gap: float = DECOMPOSE_GAP
            ) -> np.ndarray | None:
    """The plan the given prices suggest, repaired and filled; None unless it is within
    DECOMPOSE_GAP of the prices' Lagrangian bound."""
    pick, bound = _best_under(cfg, njobs, price, cap)
    plan = _repair_and_fill(cfg, pick, cap)
    if plan is None:
        return None
    value = float(cfg.value[plan[plan >= 0]].sum())
    if value < bound * (1 - gap) - 1e-12:
        return None
    x = np.zeros(len(cfg.value), dtype=bool)
    x[plan[plan >= 0]] = True
    return x


def choose(cfg: Configs, njobs: int, capacity: np.ndarray, warm: Prices | None = None,
           gap: float = DECOMPOSE_GAP) -> np.ndarray:
    """The integer program's chosen columns, by the cheapest route that is exact up to a
    certified gap (decomposition):

    1. every job's best column alone fits every pool: the capacities do not bind and that
       is the optimum (most decisions of a lightly loaded cluster);
    2. else the plan the last decision's GPU prices (`warm`) suggest, repaired and
       filled, when it is within DECOMPOSE_GAP of those prices' Lagrangian bound;
    3. else the linear relaxation: a multiple-choice knapsack with one capacity row per
       GPU type has a basic optimum with at most one fractional job per binding row, so
       the jobs it sets whole are kept and a small integer program places the fractional
       ones (and, if that is not close enough, also the OPEN_JOBS jobs the relaxation's
       GPU prices settle least firmly) in the GPUs left; a result is accepted when it is
       within DECOMPOSE_GAP of the relaxation's bound (a certificate, not a heuristic);
    4. else the full integer program (HiGHS).

    `gap` = 0 makes every route exact (the last one proves optimality): the tests.
    """
    cap = np.asarray(capacity, dtype=np.int64)
    nv = len(cfg.value)
    best = np.full(njobs, -1)
    order = np.lexsort((-cfg.value, cfg.job))
    first = np.concatenate([[True], cfg.job[order][1:] != cfg.job[order][:-1]])
    best[cfg.job[order][first]] = order[first]
    chosen = best[best >= 0]
    used = np.bincount(cfg.type[chosen], weights=cfg.n[chosen], minlength=len(cap))
    if np.all(used <= cap):
        STATS["slack"] += 1
        x = np.zeros(nv, dtype=bool)
        x[chosen] = True
        return x
    if warm is not None and warm.value is not None and len(warm.value) == len(cap):
        x = _priced(cfg, njobs, cap, warm.value, gap)
        if x is not None:
            STATS["priced"] += 1
            return x
    x_lp, bound, price = _relaxation(cfg, njobs, cap)
    if warm is not None:
        warm.value = np.maximum(price, 0.0)
    frac = np.unique(cfg.job[(x_lp > 1e-7) & (x_lp < 1 - 1e-7)])
    x = _fix_and_place(cfg, njobs, cap, x_lp, frac)
    if float(cfg.value @ x) >= bound * (1 - gap) - 1e-12:
        STATS["decomposed"] += 1
        return x
    loose = np.argsort(_margins(cfg, njobs, price), kind="stable")[:OPEN_JOBS]
    x = _fix_and_place(cfg, njobs, cap, x_lp, np.union1d(frac, loose))
    if float(cfg.value @ x) >= bound * (1 - gap) - 1e-12:
        STATS["widened"] += 1
        return x
    STATS["full"] += 1
    return _milp(cfg, njobs, cap, FULL_TIME_LIMIT_S if gap > 0 else None, gap)




def enumerate_plans(cfg: Configs, njobs: int, capacity: np.ndarray) -> tuple[float, np.ndarray]:
    """The same problem by enumerating every plan (tiny instances only, for the tests):
    (best objective, chosen columns)."""
    if njobs > 6:
        raise ValueError("enumeration is for at most 6 jobs")
    choices = [[None] + [k for k in range(len(cfg.value)) if cfg.job[k] == i] for i in range(njobs)]
    best, best_x = 0.0, np.zeros(len(cfg.value), dtype=bool)
    for combo in itertools.product(*choices):
        ks = [k for k in combo if k is not None]
        used = np.bincount(cfg.type[ks], weights=cfg.n[ks], minlength=len(capacity)) if ks else 0
        val = float(cfg.value[ks].sum()) if ks else 0.0
        if np.all(used <= capacity) and val > best + 1e-12:
            best = val
            best_x = np.zeros(len(cfg.value), dtype=bool)
            best_x[ks] = True
    return best, best_x
