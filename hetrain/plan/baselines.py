"""Baseline planners: all on the cheapest GPU type, all on the cheapest CPU type,
greedy per layer, and a genetic algorithm. All score plans with the shared cost model."""
from __future__ import annotations

import numpy as np

from ..perf.pipeline import score_assignments
from .base import Planner, Problem


def _kinds(problem: Problem, kind: str) -> list[int]:
    return [r for r, k in enumerate(problem.workload.type_kinds) if k == kind]


class _AllOn(Planner):
    kind = "gpu"

    def solve(self, problem: Problem):
        rs = _kinds(problem, self.kind)
        if not rs:
            return None, {"reason": f"the catalogue has no {self.kind.upper()} type"}
        r = min(rs, key=lambda x: problem.workload.price[x])
        return (r,) * problem.workload.n_layers, {"type": problem.workload.type_names[r]}


class AllCheapestGPU(_AllOn):
    """Every layer on the cheapest GPU type (one data-parallel stage)."""

    name = "gpu"
    kind = "gpu"


class AllCheapestCPU(_AllOn):
    """Every layer on the cheapest CPU type."""

    name = "cpu"
    kind = "cpu"


class GreedyPerLayer(Planner):
    """Each layer on the type that is cheapest for that layer alone (as a one-layer
    stage, transfers included); ties to the lower index."""

    name = "greedy"

    def solve(self, problem: Problem):
        H = problem.tables.hourly
        L = problem.workload.n_layers
        single = H[np.arange(L), np.arange(L) + 1, :]          # (L, R)
        return tuple(int(x) for x in np.argmin(single, axis=1)), {}


def penalised(hourly: np.ndarray, violation: np.ndarray, scale: float) -> np.ndarray:
    """Fitness to minimise: price, or a penalty above every feasible price."""
    return np.where(np.isfinite(hourly) & (violation == 0), hourly / scale, 1e12 * (1.0 + violation))


class Genetic(Planner):
    """Genetic algorithm over type-per-layer strings: tournament selection, two-point
    crossover, per-layer and segment mutation, elitism. Seeded."""

    name = "genetic"

    def __init__(self, population: int = 64, generations: int = 300, mutation: float | None = None,
                 seed: int = 0):
        self.population, self.generations, self.mutation, self.seed = population, generations, mutation, seed

    def solve(self, problem: Problem):
        rng = np.random.default_rng(self.seed)
        w, tables = problem.workload, problem.tables
        L, R = w.n_layers, w.n_types
        P = self.population
        pm = self.mutation if self.mutation is not None else 1.0 / L
        pop = rng.integers(0, R, size=(P, L))
        pop[: R] = np.arange(R)[:, None]  # include every uniform plan
        scale = float(np.min(w.price)) or 1.0
        fit = penalised(*score_assignments(tables, w, pop), scale)
        for _ in range(self.generations):
            a, b = rng.integers(0, P, (2, P)), rng.integers(0, P, (2, P))
            pa = np.where(fit[a[0]] <= fit[a[1]], a[0], a[1])
            pb = np.where(fit[b[0]] <= fit[b[1]], b[0], b[1])
            cut = np.sort(rng.integers(0, L + 1, (P, 2)), axis=1)
            pos = np.arange(L)[None, :]
            mask = (pos >= cut[:, :1]) & (pos < cut[:, 1:])
            child = np.where(mask, pop[pb], pop[pa])
            mut = rng.random((P, L)) < pm
            child = np.where(mut, rng.integers(0, R, (P, L)), child)
            # segment mutation: paint a random run with one type (moves stage boundaries)
            seg = rng.random(P) < 0.3
            s = rng.integers(0, L, P); e = np.minimum(L, s + rng.integers(1, max(2, L // 4), P))
            paint = seg[:, None] & (pos >= s[:, None]) & (pos < e[:, None])
            child = np.where(paint, rng.integers(0, R, P)[:, None], child)
            cfit = penalised(*score_assignments(tables, w, child), scale)
            allp = np.vstack([pop, child]); allf = np.concatenate([fit, cfit])
            keep = np.argsort(allf, kind="stable")[:P]
            pop, fit = allp[keep], allf[keep]
        best = pop[0]
        return tuple(int(x) for x in best), {"fitness": float(fit[0])}


def soft_cost(tables, w, A, scale: float, mu: float = 2.0):
    """(soft objective, feasible price or inf): the price ignoring counts, scaled up by
    mu x the relative over-use of each type's count; a huge value for impossible stages."""
    hourly, viol, raw, nbad = score_assignments(tables, w, A, raw=True)
    over = viol - nbad
    soft = np.where(nbad > 0, 1e12 * (1.0 + nbad), raw / scale * (1.0 + mu * over))
    return soft, hourly


def local_search(tables, w, assignment, rng: np.random.Generator, max_rounds: int = 60,
                 segments: int = 256, mu: float = 2.0) -> np.ndarray:
    """Steepest descent on a soft objective (price + a penalty for using more instances
    than available, so it can cross slightly infeasible plans) over three move kinds, all
    scored at once with the cost model: retype one layer, paint a run of whole stages
    with one type, paint a random segment. Returns the best feasible plan met (or the
    start)."""
    a = np.asarray(assignment, dtype=np.int64).copy()
    L, R = w.n_layers, w.n_types
    scale = float(np.min(w.price)) or 1.0
    s0, h0 = soft_cost(tables, w, a[None], scale, mu)
    cur = s0[0]
    best, best_h = a.copy(), h0[0]
    for _ in range(max_rounds):
        cands = []
        single = np.repeat(a[None], L * R, axis=0)
        single[np.arange(L * R), np.repeat(np.arange(L), R)] = np.tile(np.arange(R), L)
        cands.append(single)
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(a)) + 1, [L]])
        # segments whose ends are stage boundaries (whole stages, runs of stages), plus random
        bi, bj = np.triu_indices(len(bounds), k=1)
        if len(bi) > segments:
            pick = rng.choice(len(bi), segments, replace=False)
            bi, bj = bi[pick], bj[pick]
        s = np.concatenate([bounds[bi], rng.integers(0, L, segments)])
        e = np.concatenate([bounds[bj], np.minimum(L, s[len(bi):] + rng.integers(1, max(2, L // 3), segments))])
        pos = np.arange(L)[None, :]
        inside = (pos >= s[:, None]) & (pos < e[:, None])
        seg = np.repeat(a[None], len(s) * R, axis=0)
        inside = np.repeat(inside, R, axis=0)
        seg[inside] = np.repeat(np.tile(np.arange(R), len(s)), inside.sum(axis=1))
        cands.append(seg)
        C = np.vstack(cands)
        f, h = soft_cost(tables, w, C, scale, mu)
        j = int(np.argmin(h))
        if h[j] < best_h:
            best, best_h = C[j].copy(), h[j]
        i = int(np.argmin(f))
        if not f[i] < cur - 1e-12:
            break
        a, cur = C[i].copy(), f[i]
    return best


def _paint(a: np.ndarray, s: np.ndarray, e: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Copies of `a`, the i-th with layers s[i]..e[i]-1 set to type t[i]."""
    pos = np.arange(len(a))[None, :]
    inside = (pos >= s[:, None]) & (pos < e[:, None])
    return np.where(inside, t[:, None], a[None, :])


def neighbourhood(a: np.ndarray, R: int, rng: np.random.Generator, segments: int = 256,
                  random_segments: bool = True) -> np.ndarray:
    """Every plan one move away from `a`: retype one layer; move one stage boundary by
    1, 2, 3, 4, 6, 8, 12, ... layers either way (the neighbouring stage grows); paint a
    run of whole stages (up to `segments` runs, sampled when there are more) with any
    type; and, if `random_segments`, paint `segments` random segments with any type."""
    L = len(a)
    S, E, T = [], [], []
    ls = np.repeat(np.arange(L), R)
    S.append(ls); E.append(ls + 1); T.append(np.tile(np.arange(R), L))
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(a)) + 1, [L]])
    inner = bounds[1:-1]
    if len(inner):
        steps = np.unique(np.concatenate([[1, 2, 3], np.round(2.0 ** np.arange(2, np.log2(L) + 1, 0.5))])).astype(int)
        b = np.repeat(inner, len(steps)); d = np.tile(steps, len(inner))
        S.append(b); E.append(np.minimum(L, b + d)); T.append(a[b - 1])     # left stage grows right
        S.append(np.maximum(0, b - d)); E.append(b); T.append(a[b])          # right stage grows left
    bi, bj = np.triu_indices(len(bounds), k=1)
    if len(bi) > segments:
        pick = rng.choice(len(bi), segments, replace=False)
        bi, bj = bi[pick], bj[pick]
    S.append(np.repeat(bounds[bi], R)); E.append(np.repeat(bounds[bj], R)); T.append(np.tile(np.arange(R), len(bi)))
    if random_segments:
        s = rng.integers(0, L, segments)
        e = np.minimum(L, s + rng.integers(1, max(2, L // 3), segments))
        S.append(np.repeat(s, R)); E.append(np.repeat(e, R)); T.append(np.tile(np.arange(R), segments))
    C = _paint(a, np.concatenate(S), np.concatenate(E), np.concatenate(T))
    return C[(C != a[None, :]).any(axis=1)]


def deep_local_search(tables, w, assignment, rng: np.random.Generator, max_rounds: int = 200,
                      segments: int = 256, mu: float = 2.0, width: int = 16,
                      max_cells: int = 4_000_000) -> tuple[np.ndarray, float]:
    """Steepest descent on the soft objective of `soft_cost` over `neighbourhood`, with a
    two-move lookahead when it stalls: the `width` best distinct neighbours are each
    expanded by one more move (no random segments) and the best two-move plan is taken
    if it lowers the objective (two moves cross a count limit that one move cannot, e.g.
    trading layers between two stages of a scarce type). Every plan looked at is scored
    with the cost model, and the cheapest feasible one is kept. Returns (plan, $/h)."""
    a = np.asarray(assignment, dtype=np.int64).copy()
    L = w.n_layers
    scale = float(np.min(w.price)) or 1.0
    s0, h0 = soft_cost(tables, w, a[None], scale, mu)
    cur = float(s0[0])
    best, best_h = a.copy(), float(h0[0])

    def score(C):
        f = np.empty(len(C)); h = np.empty(len(C))
        step = max(1, max_cells // max(1, L))
        for i in range(0, len(C), step):
            f[i:i + step], h[i:i + step] = soft_cost(tables, w, C[i:i + step], scale, mu)
        return f, h

    for _ in range(max_rounds):
        C = neighbourhood(a, w.n_types, rng, segments)
        if not len(C):
            break
        f, h = score(C)
        j = int(np.argmin(h))
        if h[j] < best_h:
            best, best_h = C[j].copy(), float(h[j])
        i = int(np.argmin(f))
        if f[i] < cur - 1e-12:
            a, cur = C[i].copy(), float(f[i])
            continue
        if width <= 0:
            break
        _, first = np.unique(C, axis=0, return_index=True)
        top = first[np.argsort(f[first], kind="stable")[:width]]
        nxt_a, nxt_f = None, cur - 1e-12
        for t in top:
            C2 = neighbourhood(C[t], w.n_types, rng, segments, random_segments=False)
            f2, h2 = score(C2)
            j = int(np.argmin(h2))
            if h2[j] < best_h:
                best, best_h = C2[j].copy(), float(h2[j])
            i = int(np.argmin(f2))
            if f2[i] < nxt_f:
                nxt_a, nxt_f = C2[i].copy(), float(f2[i])
        if nxt_a is None:
            break
        a, cur = nxt_a, nxt_f
    return best, best_h


def iterated_local_search(tables, w, assignment, rng: np.random.Generator, kicks: int = 60,
                          kick_moves: int = 3, **kw) -> tuple[np.ndarray, float]:
    """`deep_local_search` from `assignment`, then `kicks` times: perturb the best plan
    by 1..kick_moves random moves from `neighbourhood` and descend again; keep the best.
    Every descent's plan also has all its boundaries placed at once (`realign`)."""
    best, best_h = _descend(tables, w, assignment, rng, **kw)
    a0 = np.asarray(assignment, dtype=np.int64)
    for _ in range(kicks):
        x = (best if np.isfinite(best_h) else a0).copy()
        for _ in range(int(rng.integers(1, kick_moves + 1))):
            C = neighbourhood(x, w.n_types, rng, 32)
            if len(C):
                x = C[int(rng.integers(len(C)))]
        b, bh = _descend(tables, w, x, rng, **kw)
        if bh < best_h:
            best, best_h = b, bh
    return best, best_h


def _descend(tables, w, start, rng, **kw) -> tuple[np.ndarray, float]:
    """`deep_local_search` from `start`, then `realign` of what it reached."""
    b, bh = deep_local_search(tables, w, start, rng, **kw)
    r, rh = realign(tables, w, b)
    return (r, rh) if rh < bh else (b, bh)


def realign(tables, w, assignment, rounds: int = 24) -> tuple[np.ndarray, float]:
    """The plan's sequence of stage types kept, every stage boundary placed at once: a
    dynamic programme over boundaries, f_s(b) = min over b' of f_{s-1}(b') + cost of
    layers b'..b-1 on the s-th type (every stage keeps at least one layer). Local search moves one or
    two boundaries at a time; on long models (200 layers) the cheapest placement of a
    given type sequence can need many moved together. Only the boundaries change, never
    the sequence (which comes from the planner that calls it). A stage's cost is its $/h
    (count limits per stage are in the stage tables); where a type repeats, the stages'
    summed instances may exceed its count, so a price per instance of each over-used type
    is added and raised (a Lagrangian relaxation, `rounds` times) until the placement
    fits. Returns the cheapest feasible plan met, or the start if none is cheaper."""
    a = np.asarray(assignment, dtype=np.int64)
    best, best_h = a, float(score_assignments(tables, w, a[None])[0][0])
    seq = a[np.concatenate([[0], np.flatnonzero(np.diff(a)) + 1])]
    lam = np.zeros(w.n_types)
    for _ in range(rounds):
        out = _place(tables, seq, lam)
        if out is None:
            break
        h, viol = score_assignments(tables, w, out[None])
        if h[0] < best_h:
            best, best_h = out, float(h[0])
        if viol[0] == 0:
            break
        used = np.zeros(w.n_types)
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(out)) + 1, [len(out)]])
        for i, j in zip(bounds[:-1], bounds[1:]):
            used[out[i]] += tables.k[i, j, out[i]]
        over = used > w.count
        if not over.any():
            break
        lam = lam + np.where(over, 0.5 * w.price * (1.0 + lam / np.maximum(w.price, 1e-12)), 0.0)
    return best, best_h


def _place(tables, seq: np.ndarray, lam: np.ndarray) -> np.ndarray | None:
    """Boundaries of the stage types `seq` at least cost, a stage costing its $/h plus
    `lam` per instance of its type (None: no placement meets the target)."""
    L = tables.n_layers
    f = np.full(L + 1, np.inf)
    f[0] = 0.0
    back = []
    lower = np.tril_indices(L + 1)
    for t in seq:
        k = tables.k[:, :, t]
        cost = f[:, None] + tables.hourly[:, :, t] + lam[t] * np.where(np.isfinite(k), k, 0.0)  # [b', b]: b'..b-1
        cost[lower] = np.inf                                                     # b' < b only
        arg = np.argmin(cost, axis=0)
        back.append(arg)
        f = cost[arg, np.arange(L + 1)]
    if not np.isfinite(f[L]):
        return None
    out = np.empty(L, dtype=np.int64)
    b = L
    for s in range(len(seq) - 1, -1, -1):
        prev = int(back[s][b])
        out[prev:b] = seq[s]
        b = prev
    return out
