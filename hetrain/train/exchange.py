"""How the balancer's workers exchange one float64 row each per re-balance (their
step-time fits and step metrics): an all-gather of its own over the worker group, or,
where the optimizer's all-reduce can carry them, a trailer on a bucket of its next step
(comm/cargo.py), which saves the collective. Rows, never pickles."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

Gather = Callable[[np.ndarray], Callable[[], np.ndarray]]


def worker_gather(ctx, what: str) -> Gather:
    """All-gather one float64 row per worker over the worker group (rows, never pickles).

    `gather(row)` starts the exchange and returns `wait()`, which gives the (workers x
    len(row)) array: the exchange can run in gloo's background threads while this worker
    computes its next step."""

    def gather(row: np.ndarray) -> Callable[[], np.ndarray]:
        t = torch.as_tensor(np.asarray(row, dtype=np.float64))
        if not (ctx.distributed and ctx.num_workers > 1):
            mine = t.numpy()[None, :]
            return lambda: mine
        out = [torch.zeros_like(t) for _ in range(ctx.num_workers)]
        try:
            work = dist.all_gather(out, t, group=ctx.worker_group, async_op=True)
        except RuntimeError as err:
            raise ctx.peer_error(what, [], err) from None

        def wait() -> np.ndarray:
            try:
                work.wait()
            except RuntimeError as err:
                raise ctx.peer_error(what, [], err) from None
            return torch.stack(out).numpy()

        return wait

    return gather


class CarriedRows:
    """The wait of an exchange whose rows ride a step's all-reduce (comm/cargo.py).
    Calling it gives the rows; where the cargo has not ridden by then (no step ran in
    between: the end of training, or a loop that wants them before its step ends) it is
    dropped and the rows are gathered then. Whether it rode depends only on where each
    worker's loop is, which is the same on every worker, so all of them gather or none."""

    def __init__(self, cargo, row: np.ndarray, gather: Gather):
        self.cargo, self.row, self.gather = cargo, row, gather

    @property
    def arrived(self) -> bool:
        return self.cargo.rows is not None

    def __call__(self) -> np.ndarray:
        if not self.arrived:
            self.cargo.drop()
            return self.gather(self.row)()
        return self.cargo.rows


def exchange_rows(row: np.ndarray, gather: Gather, carry: Callable | None) -> Callable[[], np.ndarray]:
    """Start exchanging `row`; the returned wait gives every worker's (workers x len(row)):
    riding the next step's all-reduce where `carry(row)` takes them (`CarriedRows`), else
    `gather`'s collective."""
    cargo = carry(row) if carry is not None else None
    return gather(row) if cargo is None else CarriedRows(cargo, row, gather)


def ready(wait: Callable[[], np.ndarray]) -> bool:
    """Whether `wait()` can give the rows without its cargo's step: a carried exchange
    waits for the step it rides, so it must not be completed from inside that step."""
    return not isinstance(wait, CarriedRows) or wait.arrived


def carried(wait: Callable[[], np.ndarray]) -> bool:
    """Whether `wait()` gives rows that rode a step's all-reduce (not a gather)."""
    return isinstance(wait, CarriedRows) and wait.arrived


class InProcessExchange:
    """Several simulated workers' exchanges in one process, in lockstep (a simulator's or
    a test's: real `Balancer`s of every worker driven step by step, without processes).

    Worker `rank`'s k-th row goes into slot k; the k-th wait returns every worker's row
    of that slot. Every worker must start an exchange before any waits for it, as
    balancers with `overlap_exchange` do when each updates once per step in turn. The
    first exchange (devices and memory) is answered at once with the caller's row for
    every worker: the simulated workers are alike."""

    def __init__(self, num_workers: int):
        self.n = num_workers
        self.slots: dict[int, list] = {}

    def gather_for(self, rank: int) -> Gather:
        calls = [0]

        def gather(row: np.ndarray) -> Callable[[], np.ndarray]:
            k = calls[0]
            calls[0] += 1
            row = np.asarray(row, dtype=np.float64)
            if k == 0:
                return lambda: np.vstack([row] * self.n)
            slot = self.slots.setdefault(k, [None] * self.n)
            slot[rank] = row

            def wait() -> np.ndarray:
                missing = [r for r, v in enumerate(slot) if v is None]
                if missing:
                    raise RuntimeError(f"simulated worker {rank} waited for exchange {k}, which worker(s) "
                                       f"{missing} had not started: update every worker once per step, in turn")
                self.slots.pop(k - 2, None)  # older slots are done with
                return np.vstack(slot)
            return wait
        return gather
