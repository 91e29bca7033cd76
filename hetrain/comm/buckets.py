"""All-reduce bucket sizes: PyTorch DDP's by default, then tuned on the running job.

DDP cuts gradients into a 1 MiB first bucket and 25 MiB buckets after it, so the first
all-reduce starts early in backward and overlaps with the rest of it. Whether that pays
depends on the job: each collective costs a fixed part (a round trip, thread hand-offs),
and overlap only hides transfer time where the worker has a core to spare for it. With a
core per worker the overlapped transfer takes its time from backward anyway, and every
extra bucket adds its fixed part: on the bench host one bucket for a 2.2 MB MLP beat
DDP's two (bench/hetero.py, real cases). So, as Horovod's autotuner does for its fusion
buffer, the job measures instead of guessing: `BucketTuner` runs each distinct bucket
plan of a few candidate sizes for a few steps, in interleaved blocks, the workers agree on
each plan's step time (one tiny all-reduce at the end, the slowest worker's time), and
every worker keeps the same fastest plan, DDP's unless another is faster by a clear margin.
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
    """Tries each distinct bucket plan in turn, in `rounds` mirrored rounds of blocks (a block:
    `settle` steps that absorb the switch, then `window` measured steps; the first plan
    starts after `warmup` steps), and keeps the fastest.

    `step_done(seconds, on_device)` is called by every worker at the end of every step, at
    the same step on all of them (the steps of a synchronous job are counted alike): the
    schedule is a function of the step count alone, so every worker switches plans at the
    same step and the agreement collectives line up.
    `seconds`: the step's span from the optimizer's zero_grad (or the push_pull's start
    without one) to the end of the exchange: forward, backward and exchange, what the
    bucket plan can change, the same span whether the exchange overlaps backward or runs
    at step(), and nothing the loop does between steps (evaluation, logging, another
    model's step). Blocks run in mirrored rounds (A B, then B A) so that a host whose speed
    drifts steadily slows every plan alike; a plan's time on a worker is the mean of all its measured
    steps, and the plan's time for the job the maximum over workers (the job waits for the
    slowest). Two collectives in all: after the warm-up, whether any worker's steps run on
    a GPU (then DDP's plan is kept untried: the host's clock does not see the device's
    time), and after the last block, the plans' times."""

    def __init__(self, numels: Sequence[int], agree: Agree, candidates: Sequence[BucketCaps] = CANDIDATES,
                 warmup: int = 2, settle: int = 1, window: int = 4, rounds: int = 2, margin: float = 0.03):
        self.options: list[tuple[BucketCaps, list[Partition]]] = []
        seen = set()
        for caps in candidates:
            parts = caps.plan(numels)
            cut = tuple((p.start, p.length) for p in parts)
            if cut not in seen:
                seen.add(cut)
                self.options.append((caps, parts))
        self.agree = agree
        self.warmup, self.settle, self.window, self.rounds, self.margin = warmup, settle, window, rounds, margin
        self.current = 0
        self.times: list[float] = []  # each option's agreed step time, once decided
        self.done = len(self.options) == 1
        self._step = 0  # steps ended since tuning began
        self._measured: list[list[float]] = [[] for _ in self.options]

    @property
    def caps(self) -> BucketCaps:
        return self.options[self.current][0]

    @property
    def parts(self) -> list[Partition]:
        return self.options[self.current][1]

    @property
    def trial_steps(self) -> int:
        """Steps from the start of tuning to the decision (0: nothing to tune)."""
        return 0 if self.done and not self.times else (
            self.warmup + self.rounds * len(self.options) * (self.settle + self.window))

    def _option_at(self, step: int) -> tuple[int, bool]:
        """Which plan runs at `step` (1-based, within the trials) and whether it is measured."""
        block, n = self.settle + self.window, len(self.options)
        k = max(0, step - self.warmup - 1)
        b = k // block
        option = b % n if (b // n) % 2 == 0 else n - 1 - b % n  # A B, then B A: linear drift cancels
        return option, step > self.warmup and k % block >= self.settle

    def step_done(self, seconds: float, on_device: bool = False) -> bool:
        """A step took `seconds`. True when the plan to use from the next step on changed
        (the caller rebuilds its buckets from `parts`)."""
        if self.done:
            return False
        self._step += 1
        if self._step == self.warmup:  # GPU steps anywhere? (agreed before any plan is tried)
            if self.agree([1.0 if on_device else 0.0])[0]:
                self.done = True
                return False
        option, measured = self._option_at(self._step)
        if measured:
            self._measured[option].append(seconds)
        if self._step < self.trial_steps:
            nxt = self._option_at(self._step + 1)[0]
            changed, self.current = nxt != self.current, nxt
            return changed
        self.times = self.agree([statistics.fmean(m) for m in self._measured])
        self.done = True
        best = min(range(len(self.times)), key=lambda k: (self.times[k], k))
        if self.times[best] > self.times[0] * (1 - self.margin):
            best = 0  # not clearly faster than DDP's: keep DDP's
        changed, self.current = best != self.current, best
        return changed
