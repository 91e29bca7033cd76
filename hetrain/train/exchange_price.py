"""The balancer's prices of the sets of workers that may take part in a step: what each
worker's exchange with the others costs (measured here, agreed through the balancer's
rows) and the split of the best set (`hetrain.perf.exchangeset` has the model; this is
its state inside one `Balancer`)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..perf.exchangeset import exchange_cost, fastest_sets, price_floor, priced
from ..perf.steptime import StepPlan, plan_time


class ExchangePrices:
    """This worker's measured exchange seconds (`record`, reported by `mine` with its fit)
    and every worker's agreed ones (`comm`, NaN: not measured), and what they price."""

    def __init__(self, workers: int, window: int):
        self.comm = np.full(workers, np.nan)
        self.window = window
        self._mine: list[float] = []

    def record(self, seconds: float) -> None:
        """What this worker's step just done spent beyond its compute exchanging with other
        workers (exposed exchange and waiting for them; only steps it shared an exchange
        with others: a step alone costs none). Its median over the last `window` such
        steps is what `mine` reports."""
        self._mine = [*self._mine[1 - self.window:], float(seconds)]

    def mine(self) -> float:
        return float(np.median(self._mine)) if self._mine else float("nan")

    @property
    def measured(self) -> bool:
        """Whether any worker measured its exchange (else sets are chosen on compute alone)."""
        return priced(self.comm)

    def price(self, plan: StepPlan, fixed, per) -> float:
        """`plan`'s predicted step: its compute under these fits and the exchange among its workers."""
        return plan_time(plan, fixed, per) + exchange_cost(plan.sizes > 0, self.comm)

    def floor(self, total: int, fixed, per, caps, compute_floor: float) -> float:
        """A price no split of `total` beats (`price_floor`)."""
        return price_floor(int(total), fixed, per, caps, self.comm, compute_floor)

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


def leaves_out(current: StepPlan, new: StepPlan) -> bool:
    """`new` keeps only workers of `current`'s set, and fewer of them."""
    cur, nxt = current.sizes > 0, new.sizes > 0
    return bool((nxt <= cur).all() and (nxt != cur).any())
