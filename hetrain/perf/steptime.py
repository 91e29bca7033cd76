"""The data-parallel step-time model (H-PS): how long a worker's step takes for a given
share of the global batch, and the exact min-max split of a global batch over workers.

numpy-only (scipy for the robust regression), so the planner, the scheduler, the simulator
and the runtime share one model. The runtime (`hetrain.train.balance`) feeds it measured
step times and applies the shares it solves; a planner can feed it profiled numbers.

Interface
---------
- `StepTimeModel` (`hetrain.perf.stepfit`): one worker's compute time per step as
  ``fixed + per_sample * b``, fitted online (`add(samples, seconds)`, `fit()`).
- `solve_shares(global_batch, fixed, per_sample, caps, min_samples)`: integer shares
  summing to the global batch that minimise the largest predicted step time (exact).
- `balanced_sizes(global_batch, speeds, caps)`: shares proportional to samples/s.
- `predicted_times(sizes, fixed, per_sample)`: per-worker predicted seconds;
  `step_floor(batch, fixed, per_sample)`: a bound no split of the batch's step beats.
- `memory_caps(memory, memory_per_sample, reserved_bytes, limit)`: most samples each
  worker's memory holds; `spread`, `median_spread`: how together workers finish.
- `useful_workers(...)`: who makes the step faster by taking part (a worker whose best
  share is zero sits out); `plan_unequal`, `plan_accumulate`, `plan_step`: the two
  balancing strategies (one local batch per worker by speed; equal micro-batches with a
  count per worker) and the choice between them, as a `StepPlan`.

All times are seconds, sizes are samples; arrays are one entry per worker, in rank order.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Literal, Sequence, Union

import numpy as np

from ..errors import UserError  # dependency-free: perf stays numpy-only

SMALL_SHARE = 0.1  # by default a worker whose best share is under this fraction of an equal share sits out
SmallShare = Union[float, Sequence[float], None]  # one fraction for every worker, or one per worker


class BatchDoesNotFitError(UserError):
    """The global batch needs more memory than the workers have together."""


# ---- the share solver ---------------------------------------------------------------------

def memory_caps(memory, memory_per_sample: float, reserved_bytes: float, limit: int) -> np.ndarray:
    """Most samples each worker's free memory holds (`memory` bytes per worker, of which
    `reserved_bytes` go to the model state, `memory_per_sample` to each sample), never more
    than `limit` (the global batch: no worker can use more), so an uncapped worker (no
    per-sample memory given, or unlimited memory) gets `limit` rather than a float infinity
    cast to int64."""
    mem = np.asarray(memory, dtype=float)
    if memory_per_sample <= 0:
        return np.full(len(mem), int(limit), dtype=np.int64)
    free = np.maximum(0.0, mem - reserved_bytes)
    caps = np.where(np.isfinite(free), np.floor(free / memory_per_sample), float(limit))
    return np.minimum(caps, float(limit)).astype(np.int64)


def _check_fits(global_batch: int, caps: np.ndarray, labels, memory_per_sample: float) -> None:
    if int(caps.sum()) >= global_batch:
        return
    labels = labels or [f"worker {i}" for i in range(len(caps))]
    short = global_batch - int(caps.sum())
    per = ", ".join(f"{lab}: {int(c)}" for lab, c in zip(labels, caps))
    extra = f" ({short * memory_per_sample / 2**20:.1f} MiB)" if memory_per_sample > 0 else ""
    raise BatchDoesNotFitError(
        f"the global batch of {global_batch} samples does not fit in the cluster's memory: the workers hold "
        f"at most {int(caps.sum())} samples together ({per}); short by {short} samples{extra}. "
        "Lower the global batch, add workers or memory, or reduce the memory each sample needs.")


def solve_shares(global_batch: int, fixed, per_sample, caps, min_samples: int = 1, labels=None,
                 memory_per_sample: float = 0.0) -> np.ndarray:
    """Integer shares adding up to `global_batch` that minimise the largest predicted
    step time max_i (fixed_i + per_sample_i · b_i), with min(min_samples, cap_i) ≤ b_i ≤ cap_i.

    Exact, not a heuristic: with increasing linear times the optimum is reached by
    handing out samples one at a time, each to the worker that would finish soonest
    with it (the classic greedy for min-max separable resource allocation, which picks
    the `global_batch` smallest "finish time of one more sample" values). To keep it
    O(n log n) rather than O(global batch), the continuous water level is found first:
    Σ clip((T − fixed_i)/per_sample_i, lo_i, cap_i) is piecewise linear in T with its
    kinks where a worker leaves its minimum or reaches its cap, so T is interpolated
    exactly between the two kinks around the batch (`_water_level`). Flooring at that
    level is the state the greedy reaches after its first picks; the last ≤ n picks are
    handed out greedily (ties: lower rank). A MILP (HiGHS) gives the same optimum (checked
    by the tests) at far higher cost. Hand-written in plain Python floats: it runs at every
    re-balance, inside training, for a few workers, where numpy's per-call cost (caches
    cold from the compute) made it hundreds of microseconds per step. Deterministic.
    Every worker below its cap is predicted to finish within one of its own per-sample
    times of the slowest worker given samples."""
    g = int(global_batch)
    caps_l = [min(int(c), g) for c in np.asarray(caps, dtype=np.int64).ravel().tolist()]
    if sum(caps_l) < g:
        _check_fits(g, np.asarray(caps_l, dtype=np.int64), labels, memory_per_sample)
    n = len(caps_l)
    m = min_samples if g >= min_samples * n else 0
    lo = [min(c, m) for c in caps_l]
    f = [x if (math.isfinite(x) and x > 0) else 0.0 for x in np.asarray(fixed, dtype=float).ravel().tolist()]
    p = np.asarray(per_sample, dtype=float).ravel().tolist()
    good = [x for x in p if math.isfinite(x) and x > 0]
    fill = sum(good) / len(good) if good else 1.0
    p = [max(x if (math.isfinite(x) and x > 0) else fill, 1e-15) for x in p]
    if g - sum(lo) <= 0:
        return _trim(np.asarray(lo, dtype=np.int64), g, np.asarray(f), np.asarray(p))
    level = _water_level(g, f, p, lo, caps_l)
    sizes = [min(max(math.floor((level - f[i]) / p[i]), lo[i]), caps_l[i]) for i in range(n)]
    # float rounding at the level may have taken a pick too many: give back the latest
    for _ in range(sum(sizes) - g):
        i = max((k for k in range(n) if sizes[k] > lo[k]), key=lambda k: (f[k] + p[k] * sizes[k], k))
        sizes[i] -= 1
    heap = [(f[i] + p[i] * (sizes[i] + 1), i) for i in range(n) if sizes[i] < caps_l[i]]
    heapq.heapify(heap)
    for _ in range(g - sum(sizes)):
        _t, i = heapq.heappop(heap)
        sizes[i] += 1
        if sizes[i] < caps_l[i]:
            heapq.heappush(heap, (f[i] + p[i] * (sizes[i] + 1), i))
    return np.asarray(sizes, dtype=np.int64)


def _water_level(batch: int, fixed: list[float], per: list[float], lo: list[int], caps: list[int]) -> float:
    """The T at which S(T) = Σ clip((T − fixed_i)/per_i, lo_i, caps_i) = batch (Σ lo < batch ≤ Σ caps).

    S is non-decreasing and linear between the kinks fixed_i + per_i·lo_i and
    fixed_i + per_i·caps_i: a binary search over the sorted kinks (S evaluated exactly
    at each probe) finds the two around the batch, and T is interpolated between them."""
    def count(t: float) -> float:
        return sum(min(max((t - fi) / pi, li), ci) for fi, pi, li, ci in zip(fixed, per, lo, caps))

    kinks = sorted({fi + pi * li for fi, pi, li in zip(fixed, per, lo)}
                   | {fi + pi * ci for fi, pi, ci in zip(fixed, per, caps)})
    a, b = 0, len(kinks) - 1  # count(kinks[a]) < batch (a = 0: everyone at lo); find the first >= batch
    if count(kinks[b]) < batch:  # rounding left the top kink a hair short: every worker at its cap
        return kinks[b]
    while b - a > 1:
        mid = (a + b) // 2
        if count(kinks[mid]) < batch:
            a = mid
        else:
            b = mid
    c0, c1 = count(kinks[a]), count(kinks[b])
    if c1 <= c0:
        return kinks[b]
    return kinks[a] + (batch - c0) / (c1 - c0) * (kinks[b] - kinks[a])


def step_floor(batch: int, fixed, per_sample) -> float:
    """No split of `batch` samples (either strategy) is predicted faster than the water
    level T with Σ max(0, T − fixed_i) / per_sample_i = batch: a worker with b_i samples
    ends at fixed_i + per_sample_i · b_i or later (accumulating, its fixed part per pass
    on top) and the b_i add up to the batch. NaN unless fixed ≥ 0 and per_sample > 0.
    Lets the balancer skip solving a strategy that cannot win (it doubled the solve)."""
    f, p, b = np.asarray(fixed, float).ravel().tolist(), np.asarray(per_sample, float).ravel().tolist(), int(batch)
    if b < 1 or not all(math.isfinite(x) and x >= 0 for x in f) or not all(math.isfinite(x) and x > 0 for x in p):
        return float("nan")
    ws, inv, fsum = sorted(zip(f, p)), 0.0, 0.0  # water-filling: workers join in order of fixed part
    for k, (fi, pi) in enumerate(ws):
        inv, fsum = inv + 1 / pi, fsum + fi / pi
        if k + 1 == len(ws) or (b + fsum) / inv <= ws[k + 1][0]:
            return (b + fsum) / inv
    return float("nan")  # no workers


def _trim(lo: np.ndarray, global_batch: int, fixed, per) -> np.ndarray:
    """More forced minimum samples than the batch (only when caps force it): take back
    from the workers predicted to finish last."""
    sizes = lo.copy()
    while sizes.sum() > global_batch:
        t = np.where(sizes > 0, fixed + per * sizes, -np.inf)
        sizes[int(np.argmax(t))] -= 1
    return sizes


def balanced_sizes(global_batch: int, speeds, caps, min_samples: int = 1, labels=None,
                   memory_per_sample: float = 0.0) -> np.ndarray:
    """Shares proportional to `speeds` (samples/s): `solve_shares` with no fixed part."""
    speeds = np.asarray(speeds, dtype=float)
    per = np.where(np.isfinite(speeds) & (speeds > 0), 1.0 / np.where(speeds > 0, speeds, 1.0), np.nan)
    return solve_shares(global_batch, np.zeros(len(speeds)), per, caps, min_samples, labels, memory_per_sample)


def predicted_times(sizes, fixed, per_sample) -> np.ndarray:
    return np.asarray(fixed, dtype=float) + np.asarray(per_sample, dtype=float) * np.asarray(sizes, dtype=float)


def spread(times, samples=None) -> float:
    """max / min of per-worker compute times over the workers that had samples (1 = together)."""
    t = np.asarray(times, dtype=float)
    if samples is not None:
        t = t[np.asarray(samples) > 0]
    t = t[np.isfinite(t) & (t > 0)]
    return float(t.max() / t.min()) if len(t) else float("nan")


def median_spread(spreads, skip: int) -> float:
    """Median of per-step spreads after the first `skip` steps (all if no more), NaNs ignored."""
    s = np.asarray(list(spreads)[skip:] if len(spreads) > skip else list(spreads), dtype=float)
    s = s[np.isfinite(s)]
    return float(np.median(s)) if len(s) else float("nan")


# ---- who is worth a share, and how to split: the two balancing strategies --------------

def useful_workers(global_batch: int, fixed, per_sample, caps, min_samples: int = 1, margin: float = 0.1,
                   small_share: SmallShare = None) -> np.ndarray:
    """Which workers make the step faster by taking part (bool per worker).

    A worker given even `min_samples` costs the step its fixed part plus those samples;
    when that alone ends later than the step would without it (a straggler too slow to
    help, or a device whose fixed cost exceeds the others' whole step), its best share
    is zero. The workers with the slowest minimums are dropped, as many as make the
    predicted step (max over the workers with samples) shortest, when that beats keeping
    them all by more than `margin` (fits are noisy: a worker is not sent away for a
    predicted 1%); then, whoever's best share is under `small_share` of an equal share
    (default `SMALL_SHARE`, a tenth; 0: none). A worker the rest cannot hold the batch
    without stays. A dropped worker rejoins once the fits say it helps (solved again)."""
    return _useful(global_batch, fixed, per_sample, caps, min_samples, margin, small_share)[0]


def _useful(global_batch: int, fixed, per_sample, caps, min_samples: int = 1, margin: float = 0.1,
            small_share: SmallShare = None) -> tuple[np.ndarray, np.ndarray | None]:
    """`useful_workers`, and the shares of the workers kept (None: nothing forced on anyone,
    or the batch does not fit, which the solver reports).

    Most steps drop nobody, and that is known from one solve: when the slowest worker
    is not held at its minimum, the step ends at the water level of the free workers,
    which leaving any worker out cannot lower by more than the largest per-sample time
    (the others take its samples: the continuous level only rises, and the integer
    step sits within one sample of it). The drop search runs only otherwise. Plain
    Python floats, as in `solve_shares` (it runs at every re-balance)."""
    g = int(global_batch)
    f = [x if math.isfinite(x) else 0.0 for x in np.asarray(fixed, dtype=float).ravel().tolist()]
    p = np.asarray(per_sample, dtype=float).ravel().tolist()
    c = [min(int(v), g) for v in np.asarray(caps, dtype=np.int64).ravel().tolist()]
    n = len(c)
    keep = [v > 0 for v in c]
    if min_samples < 1 or sum(c) < g:  # nothing forced on anyone / the solver says why not
        return np.asarray(keep), None

    def step(mask: list[bool]) -> tuple[float, np.ndarray]:
        sizes = solve_shares(g, [f[i] if mask[i] else 0.0 for i in range(n)],
                             [p[i] if mask[i] else 1.0 for i in range(n)], [c[i] if mask[i] else 0 for i in range(n)],
                             min_samples)
        t = [f[i] + p[i] * int(sizes[i]) for i in range(n) if sizes[i] > 0]
        return (float("nan") if any(math.isnan(x) for x in t) else max(t, default=float("inf"))), sizes

    best, first = step(keep)
    lo_min = min_samples if g >= min_samples * n else 0
    slowest = max((i for i in range(n) if first[i] > 0), key=lambda i: f[i] + p[i] * int(first[i]))
    held = first[slowest] <= min(c[slowest], lo_min)
    if not held and max(p[i] for i in range(n) if keep[i]) <= margin * best:
        return _without_small_shares(g, c, keep, first, step, small_share)
    # drop the k slowest minimums for the best k, not one at a time until one drop fails to
    # help: several stragglers of about the same minimum (CPU workers beside a GPU) each
    # hold the step alone, so leaving out any one of them changes nothing
    start = list(keep)
    order = sorted(range(n), key=lambda i: -(f[i] + p[i] * min_samples))  # stable: ties by rank
    trial, best_keep, best_trial = list(keep), list(keep), best
    for i in order:
        if sum(trial) <= 1:
            break
        if not trial[i]:
            continue
        trial[i] = False
        if sum(min(c[k], g) for k in range(n) if trial[k]) < g:
            trial[i] = True  # the others cannot hold the batch without it
            continue
        t_trial, _ = step(trial)
        if t_trial < best_trial:
            best_keep, best_trial = list(trial), t_trial
    if best_trial < best * (1 - margin):
        keep = best_keep
    return _without_small_shares(g, c, keep, first if keep == start else step(keep)[1], step, small_share)


def _without_small_shares(g: int, c: list[int], keep: list[bool], sizes: np.ndarray, step,
                          small_share: SmallShare = None) -> tuple[np.ndarray, np.ndarray]:
    """Leave out the workers whose share is under `small_share` (default `SMALL_SHARE`; a
    fraction per worker where a sequence) of an equal one (smallest first, a worker the
    rest need for the batch stays), solve again, until none is left.

    Such a worker shortens the compute by a few percent at most, and a worker in the step
    costs what the compute fits do not see: its part in the exchange (every worker's
    gradients arrive at the servers at once when all finish together) and its load on a
    shared host. On a GPU beside three CPU workers of 4 threads, shares of 1 to 5% of an
    equal one made the step 22 to 34% longer than the same job with those workers
    at zero samples (`bench/hetero_real.py`)."""
    n, given = len(c), SMALL_SHARE if small_share is None else small_share
    frac = [float(given)] * n if np.isscalar(given) else [float(x) for x in given]
    while sum(keep) > 1:
        small = sorted((i for i in range(n) if keep[i] and sizes[i] < frac[i] * g / sum(keep)),
                       key=lambda i: int(sizes[i]))
        trial = list(keep)
        for i in small:
            if sum(trial) <= 1:
                break
            trial[i] = False
            if sum(min(c[k], g) for k in range(n) if trial[k]) < g:
                trial[i] = True  # the others cannot hold the batch without it
        if trial == keep:
            break
        keep = trial
        sizes = step(keep)[1]
    return np.asarray(keep), sizes


Strategy = Literal["unequal", "accumulate"]  # see StepPlan


@dataclass(frozen=True)
class StepPlan:
    """How one step is split: the strategy, each worker's samples and (accumulate) its
    count of micro-batches, and the predicted step time (seconds, compute).

    - "unequal": each worker one local batch of its own size; the gradients are averaged
      weighted by batch size (H-PS). Fine-grained (one sample), so never slower in
      compute, but a worker's batch is capped by its memory.
    - "accumulate": every worker runs micro-batches of the same size `micro` and a count
      of its own, accumulating gradients (IIDP/JABAS's virtual workers): every forward
      sees the same batch size, as in synchronous SGD, and a fast device's memory caps
      the micro-batch only, not its share. Coarser (whole micro-batches) and each pass
      pays the per-pass fixed cost, so it wins only where memory caps the other."""

    strategy: Strategy
    sizes: np.ndarray  # samples per worker (sum: the batch)
    micro: int  # accumulate: samples per micro-batch (0 for unequal)
    counts: np.ndarray  # passes per worker (unequal: 1, or 0 for a worker left out)
    predicted: float  # predicted compute seconds of the step (the slowest worker)

    def __repr__(self) -> str:
        return (f"StepPlan({self.strategy}, sizes={self.sizes.tolist()}, micro={self.micro}, "
                f"counts={self.counts.tolist()}, predicted={self.predicted:.4g}s)")


def plan_time(plan: StepPlan, fixed, per_sample, pass_fixed=None) -> float:
    """Predicted compute seconds of `plan`'s step under these fits: its slowest worker that
    takes part (accumulating: k_i passes, each paying `pass_fixed`, default `fixed`), as
    the planners predict their own plans. Lets a caller price a plan made with older fits.
    Plain floats: the balancer prices the split in use at every re-balance, in the step."""
    f, p = [float(x) for x in fixed], [float(x) for x in per_sample]
    counts = plan.counts.tolist()
    if plan.strategy == "accumulate":
        pf = f if pass_fixed is None else [float(x) for x in pass_fixed]
        n, unit = counts, [a + plan.micro * b for a, b in zip(pf, p)]
    else:
        n, unit = plan.sizes.tolist(), p
    return max((f[i] + n[i] * unit[i] for i in range(len(f)) if counts[i] > 0), default=0.0)


def plan_unequal(global_batch: int, fixed, per_sample, caps, min_samples: int = 1, labels=None,
                 memory_per_sample: float = 0.0, drop: bool = True, small_share: SmallShare = None) -> StepPlan:
    """Shares for the unequal-batch strategy, with workers that would not help left out
    unless `drop` is False (`labels`, `memory_per_sample`: for the message when the batch
    does not fit)."""
    fixed = np.asarray(fixed, dtype=float)
    per = np.asarray(per_sample, dtype=float)
    caps = np.minimum(np.asarray(caps, dtype=np.int64), int(global_batch))
    keep, sizes = (_useful(global_batch, fixed, per, caps, min_samples, small_share=small_share) if drop
                   else (caps > 0, None))
    if sizes is None:
        sizes = solve_shares(global_batch, fixed, per, np.where(keep, caps, 0), min_samples, labels,
                             memory_per_sample)
    t = predicted_times(sizes, fixed, per)
    return StepPlan("unequal", sizes, 0, (sizes > 0).astype(np.int64), float(np.max(t[sizes > 0], initial=0.0)))


def plan_accumulate(global_batch: int, micro: int, fixed, per_sample, micro_caps=None, pass_fixed=None,
                    min_passes: int = 1, drop: bool = True, small_share: SmallShare = None) -> StepPlan:
    """Counts of equal micro-batches of `micro` samples (the last one of the step may be
    smaller when `micro` does not divide the batch): worker i runs k_i passes costing
    fixed_i + k_i · (pass_fixed_i + micro · per_sample_i); Σ k_i · micro covers the global
    batch. `micro_caps`: most passes a worker may run (default: no limit); a worker only
    needs the memory of one micro-batch."""
    if micro < 1:
        raise UserError(f"micro-batch must be >= 1 sample, got {micro}")
    fixed = np.asarray(fixed, dtype=float)
    per = np.asarray(per_sample, dtype=float)
    n = len(fixed)
    units = -(-int(global_batch) // int(micro))
    pf = np.zeros(n) if pass_fixed is None else np.asarray(pass_fixed, dtype=float)
    caps = np.full(n, units, dtype=np.int64) if micro_caps is None else np.asarray(micro_caps, dtype=np.int64)
    per_unit = pf + micro * np.where(np.isfinite(per) & (per > 0), per, np.nanmean(per) if np.isfinite(per).any() else 1.0)
    keep = useful_workers(units, fixed, per_unit, caps, min_passes, small_share=small_share) if drop else caps > 0
    counts = solve_shares(units, fixed, per_unit, np.where(keep, caps, 0), min_passes)
    sizes = counts * micro
    extra = int(sizes.sum()) - int(global_batch)  # the step's last micro-batch is short
    if extra > 0:
        last = int(np.flatnonzero(counts > 0)[-1])
        sizes[last] -= extra
    t = predicted_times(counts, fixed, per_unit)
    return StepPlan("accumulate", sizes, int(micro), counts, float(np.max(t[counts > 0], initial=0.0)))


def plan_step(global_batch: int, fixed, per_sample, caps, micro: int = 0, micro_caps=None, pass_fixed=None,
              strategy: Literal["auto", "unequal", "accumulate"] = "auto", min_samples: int = 1, labels=None,
              memory_per_sample: float = 0.0, drop: bool = True, small_share: SmallShare = None) -> StepPlan:
    """The faster of the two strategies for these fits (`strategy="auto"`), or the one
    asked for. Ties go to "unequal" (one pass per worker). "accumulate" needs `micro`.
    `drop`: leave out workers too slow to help, `small_share`: and those whose best share
    is under that fraction of an equal share (`useful_workers`)."""
    if strategy not in ("auto", "unequal", "accumulate"):
        raise UserError(f"balancing strategy must be 'auto', 'unequal' or 'accumulate', got {strategy!r}")
    if strategy == "accumulate" or (strategy == "auto" and micro > 0):
        acc = plan_accumulate(global_batch, micro, fixed, per_sample, micro_caps, pass_fixed, min(1, min_samples),
                              drop, small_share)
        if strategy == "accumulate":
            return acc
    try:
        une = plan_unequal(global_batch, fixed, per_sample, caps, min_samples, labels, memory_per_sample, drop,
                           small_share)
    except BatchDoesNotFitError:
        if strategy == "auto" and micro > 0:
            return acc
        raise
    if strategy == "auto" and micro > 0 and acc.predicted < une.predicted * (1 - 1e-9):
        return acc
    return une
