"""All-reduce bucket sizes: PyTorch DDP's by default, then tuned on the running job.

DDP cuts gradients into a 1 MiB first bucket and 25 MiB buckets after it, so the first
all-reduce starts early in backward and overlaps with the rest of it. Whether that pays
depends on the job: each collective costs a fixed part (a round trip, thread hand-offs),
and overlap only hides transfer time where the worker has a core to spare for it. With a
core per worker the overlapped transfer takes its time from backward anyway, and every
extra bucket adds its fixed part: on the bench host one bucket for a 2.2 MB MLP beat
DDP's two (bench/hetero.py, real cases). So, as Horovod's autotuner does for its fusion
buffer, the job measures instead of guessing: `BucketTuner` runs each distinct bucket
plan of a few candidate sizes for a few steps, the workers agree on each plan's step time
(one tiny all-reduce at the end of each trial, the slowest worker's time), and every
worker keeps the same fastest plan, DDP's unless another is faster by a clear margin.
Plans that cut the model the same way are tried once; a model that fits one bucket under
every candidate is never tuned (no trial, no extra collective).

Pure logic: the engine (comm/engine.py) gives it step end times and the agreement
collective, and rebuilds its layout when `step_done` says the plan changed.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .partition import Partition, plan_buckets


@dataclass(frozen=True)
class BucketCaps:
    """Bucket sizes in bytes of fp32 gradients: the first bucket of a step (the last
    layers' gradients, produced first) and every later one."""

    first_bytes: int
    bytes: int

    def plan(self, numels: Sequence[int]) -> list[Partition]:
        return plan_buckets(numels, max(1, self.first_bytes // 4), max(1, self.bytes // 4))


DDP_CAPS = BucketCaps(2**20, 25 * 2**20)  # DDP's first_bucket_bytes_cap and bucket_cap_mb
# DDP's first, then fewer and larger buckets (less overlap, fewer collectives)
CANDIDATES = (DDP_CAPS, BucketCaps(25 * 2**20, 25 * 2**20), BucketCaps(100 * 2**20, 100 * 2**20))

Agree = Callable[[list[float]], list[float]]  # element-wise max over the job's workers (a collective)


class BucketTuner:
    """Tries each distinct bucket plan for `window` measured steps (after `settle` steps
    that absorb the switch; the first plan after `warmup`) and keeps the fastest.

    `step_done(seconds, on_device)` is called by every worker at the end of every step, at
    the same step on all of them (the steps of a synchronous job are counted alike), so
    the agreement collectives line up. `seconds`: the step's span from its push_pull's
    start (the optimizer starts it at zero_grad, so forward is in) to the end of the
    exchange: what the bucket plan can change, and nothing the loop does between steps
    (evaluation, logging, another model's step). The median of a trial's steps on each
    worker, then the maximum over workers (the job waits for the slowest), is the plan's
    time. A step on a GPU (`on_device` on any worker) ends tuning with DDP's plan: the
    host's clock does not see the device's time there."""

    def __init__(self, numels: Sequence[int], agree: Agree, candidates: Sequence[BucketCaps] = CANDIDATES,
                 warmup: int = 2, settle: int = 1, window: int = 5, margin: float = 0.03):
        self.options: list[tuple[BucketCaps, list[Partition]]] = []
        seen = set()
        for caps in candidates:
            parts = caps.plan(numels)
            cut = tuple((p.start, p.length) for p in parts)
            if cut not in seen:
                seen.add(cut)
                self.options.append((caps, parts))
        self.agree = agree
        self.warmup, self.settle, self.window, self.margin = warmup, settle, window, margin
        self.current = 0
        self.times: list[float] = []  # each option's agreed step time, in order of trial
        self.done = len(self.options) == 1
        self._steps = 0  # steps ended under the current option
        self._measured: list[float] = []

    @property
    def caps(self) -> BucketCaps:
        return self.options[self.current][0]

    @property
    def parts(self) -> list[Partition]:
        return self.options[self.current][1]

    def step_done(self, seconds: float, on_device: bool = False) -> bool:
        """A step took `seconds`. True when the plan to use from the next step on changed
        (the caller rebuilds its buckets from `parts`)."""
        if self.done:
            return False
        self._steps += 1
        if self._steps > (self.warmup + self.settle if self.current == 0 else self.settle):
            self._measured.append(seconds)
        if len(self._measured) < self.window:  # the same step on every worker: the collective lines up
            return False
        mine = statistics.median(self._measured) if self._measured else 0.0
        agreed_time, any_device = self.agree([mine, 1.0 if on_device else 0.0])
        if any_device:  # a GPU step: keep DDP's plan (the first), untuned
            self.done = True
            changed, self.current = self.current != 0, 0
            return changed
        self.times.append(agreed_time)
        self._steps, self._measured = 0, []
        if len(self.times) < len(self.options):
            self.current += 1
            return True
        self.done = True
        best = min(range(len(self.times)), key=lambda k: (self.times[k], k))
        if self.times[best] > self.times[0] * (1 - self.margin):
            best = 0  # not clearly faster than DDP's: keep DDP's
        changed, self.current = best != self.current, best
        return changed
