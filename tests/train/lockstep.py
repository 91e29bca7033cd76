"""Several real `Balancer`s driven step by step in one process, as BalancedBatchSampler
drives them in a job: the tests' simulated workers (no processes, no clocks)."""
from __future__ import annotations

from typing import Callable

import numpy as np

EXCHANGE_S = 0.010  # what a step shared by every worker spends exchanging, as each records it


def drive(bal: list, steps: int, compute: Callable[[int, np.ndarray], np.ndarray],
          hidden: Callable[[bool], float] = lambda both: 0.0, leave: bool = False) -> list[list[int]]:
    """Run `steps` steps of the balancers `bal` (one per worker, sharing an
    `InProcessExchange`): every worker takes the agreed split (checked equal on all), a
    worker with samples records `compute(step, sizes)[rank]` seconds, the step's period
    (start to start: the slowest compute, `EXCHANGE_S` plus `hidden(both)` where every
    worker is in, 1 ms of loop) and, from the second step on, the exchange of a step
    every worker shared; with `leave`, a step one worker trained tells the balancers so,
    as the sampler does where workers leave the exchange. Returns the shares per step."""
    shares = []
    for step in range(steps):
        plans = [b.step_plan() for b in bal]
        sizes = plans[0].sizes
        assert all(p.sizes.tolist() == sizes.tolist() for p in plans), [p.sizes for p in plans]
        assert len({b.probing for b in bal}) == 1
        members = sizes > 0
        both = bool(members.all())
        seconds = np.where(members, compute(step, sizes), 0.0)
        period = seconds.max() + (EXCHANGE_S + hidden(both) if both else 0.0) + 1e-3
        for r, b in enumerate(bal):
            if members[r]:
                b.record(int(sizes[r]), float(seconds[r]))
                b.record_period(members, float(period), counted=not b.probing)
                if both and step > 0:
                    b.record_exchange(EXCHANGE_S)
            b.update(alone=leave and int(members.sum()) == 1)
        shares.append(sizes.tolist())
    return shares
