"""The balancer's prices of the sets of workers that may take part in a step: what each
worker's exchange with the others costs (measured here, agreed through the balancer's
rows) and the split of the best set (`hetrain.perf.exchangeset` has the model; this is
its state inside one `Balancer`)."""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from ..perf.comm import MEMCPY_SPEED, shm_allreduce_time
from ..perf.exchangeset import exchange_cost, fastest_sets, price_floor, priced
from ..perf.steptime import StepPlan, plan_time
from ..runtime.shmnames import same_host

# steps of a kind of exchange measured before it is priced (after a set's first, never
# counted): the next few still pay some of the start, and on a loaded host one spike
# among two or three is their median; a worker priced out on them is measured again only
# by the probes (every 64 steps, then less often)
PRICED_AFTER = 4


class ExchangePrices:
    """This worker's measured exchange seconds (`record`, reported by `mine` with its fit)
    and every worker's agreed prices, with every worker in (`comm`) and in sets short of
    the job (`part`; NaN: not measured), and what they price (`hetrain.perf.exchangeset`).

    A step's exchange is the least number its members report for it (`receive`): all end
    the step together, so the member that reached the exchange last (computed longest,
    or started last) waited least, and its number is the exchange alone. Each worker's
    price of a kind is the median of that over the last `window` steps of the kind it
    took part in: every worker computes the same from the same rows. (A median of each
    worker's own numbers, least of them taken after, would price the exchange by the
    worker that reached it last least often: on a loaded host twice the exchange.)"""

    def __init__(self, workers: int, window: int, short: Callable[[int], float] | None = None):
        self.short = short  # modelled all-reduce of k workers of one host (`host_allreduce`), or None
        self.comm = np.full(workers, np.nan)
        self.part = np.full(workers, np.nan)
        self.window = window
        self._mine: dict[bool, list[float]] = {True: [], False: []}  # since the last report
        self._steps = {kind: [[] for _ in range(workers)] for kind in (True, False)}  # per worker, per step
        self._sets: dict[tuple[int, ...], int] = {}  # exchanges begun per set of workers

    def kind_of(self, members, samples: int) -> bool | None:
        """What this worker's step among the workers `members` (indices; every worker
        calls this at every step) measures: the whole job's exchange (True), a set short
        of it (False), or nothing (None): not where this worker is out or alone, nor at a
        set's first exchange, which makes the set's group, announces the layout and
        connects to the servers (the demo's first exchange, priced like the next, took
        three of its four workers out of the run)."""
        key = tuple(int(i) for i in members)
        seen = self._sets.get(key, 0)
        self._sets[key] = seen + 1
        if samples <= 0 or len(key) <= 1 or not seen:
            return None
        return len(key) == len(self.comm)

    def record(self, seconds: float, whole: bool = True) -> None:
        """What this worker's step just done spent beyond its compute exchanging with other
        workers (exposed exchange and waiting for them; only steps it shared an exchange
        with others, not a set's first: a step alone costs none), with every worker in
        (`whole`) or in a set short of the job."""
        self._mine[whole].append(float(seconds))

    def mine(self) -> tuple[float, float]:
        """(whole job, set short of it): this worker's exchange seconds of each kind since
        the last report (their median where the fits are exchanged every few steps; NaN:
        none), for the row it sends now."""
        out = tuple(float(np.median(v)) if v else float("nan") for v in (self._mine[True], self._mine[False]))
        self._mine = {True: [], False: []}
        return out

    def receive(self, whole, part) -> None:
        """Every worker's `mine` of one exchange of rows (NaN: not measured): the step's
        exchange of each kind, the least among the workers that measured it, goes to
        each of them, and their prices are the medians of their last `window`, once
        they hold `PRICED_AFTER`."""
        for kind, col, out in ((True, whole, self.comm), (False, part, self.part)):
            col = np.asarray(col, dtype=float)
            good = np.isfinite(col) & (col > 0)
            if not good.any():
                continue
            least = float(col[good].min())
            for i in np.flatnonzero(good):
                hist = self._steps[kind][i] = [*self._steps[kind][i][1 - self.window:], least]
                out[i] = float(np.median(hist)) if len(hist) >= min(PRICED_AFTER, self.window) else np.nan

    def error(self, members) -> float:
        """Standard error of the exchange price of the set `members` (bool per worker):
        of the median of the steps behind it (1.25 x the MAD-based deviation / sqrt(k)),
        the member whose price is the set's; 0 for one worker or none measured."""
        m = np.asarray(members, dtype=bool)
        if m.sum() <= 1:
            return 0.0
        kind = bool(m.all())
        prices = np.where(m, self.comm if kind else self.part, np.nan)
        if not np.isfinite(prices).any():
            return 0.0
        hist = np.asarray(self._steps[kind][int(np.nanargmin(prices))])
        mad = float(np.median(np.abs(hist - np.median(hist))))
        return 1.2533 * 1.4826 * mad / np.sqrt(len(hist))

    @property
    def measured(self) -> bool:
        """Whether any worker measured its exchange (else sets are chosen on compute alone)."""
        return priced(self.comm, self.part)

    def price(self, plan: StepPlan, fixed, per) -> float:
        """`plan`'s predicted step: its compute under these fits and the exchange among its workers."""
        return plan_time(plan, fixed, per) + exchange_cost(plan.sizes > 0, self.comm, self.part, self.short)

    def floor(self, total: int, fixed, per, caps, compute_floor: float) -> float:
        """A price no split of `total` beats (`price_floor`)."""
        return price_floor(int(total), fixed, per, caps, self.comm, compute_floor, self.part)

    def best(self, plan: StepPlan, total: int, fixed, per, caps, solve: Callable[[np.ndarray], StepPlan]) -> StepPlan:
        """`plan` (the compute-optimal split) or `solve(mask)`, the split of a set of the
        fastest workers alone, whichever is predicted faster with the exchange among its
        workers: the best subset of devices is always a candidate."""
        best, best_t = plan, self.price(plan, fixed, per)
        for mask in fastest_sets(total, fixed, per, caps):
            if bool((mask == (plan.sizes > 0)).all()):
                continue
            cand = solve(mask)
            t = self.price(cand, fixed, per)
            if t < best_t:
                best, best_t = cand, t
        return best


def host_allreduce(ctx, params) -> Callable[[int], float] | None:
    """The cost model's all-reduce of `params`' gradients among k workers of a job whose
    workers all share this host (one node, links not emulated, launched by hetrain: the
    runtime then all-reduces through shared memory, comm/shm/select.py), at the default
    memcpy speed over this process's cores; None elsewhere."""
    if ctx is None or not getattr(ctx, "distributed", False) or getattr(ctx, "env", None) is None:
        return None
    if ctx.env.origin != "hetrain" or not hasattr(os, "sched_getaffinity"):
        return None
    if not same_host(ctx.topology, ctx.cluster, ctx.topology.worker_ranks):
        return None
    nbytes = float(sum(p.numel() * p.element_size() for p in params))
    cores = len(os.sched_getaffinity(0))
    return lambda k: shm_allreduce_time(nbytes, k, MEMCPY_SPEED, cores)


def leaves_out(current: StepPlan, new: StepPlan) -> bool:
    """`new` keeps only workers of `current`'s set, and fewer of them."""
    cur, nxt = current.sizes > 0, new.sizes > 0
    return bool((nxt <= cur).all() and (nxt != cur).any())
