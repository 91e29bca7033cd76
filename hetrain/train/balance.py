"""Measured batch balancing (H-PS): each worker's share of the global batch follows its
measured samples/s and is capped by its free memory, so all workers finish a step
together.

Every worker measures its own compute speed; the speeds are all-gathered as one
float64 tensor over the worker group, and every worker then runs the same pure
function (`balanced_sizes`) on the same numbers, so all workers agree on the shares
without a coordinator. The global batch never changes, and push_pull weights each
gradient by its batch size, so the update is the one a single machine would compute
on the whole global batch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..errors import UserError


class BatchDoesNotFitError(UserError):
    """The global batch needs more memory than the workers have together."""


@dataclass(frozen=True)
class BalanceConfig:
    """How shares follow speed. Validated so a bad value fails before training starts."""

    window: int = 3  # speed = median of the last `window` steps' samples/s (robust to one outlier)
    every: int = 1  # re-balance every `every` steps
    memory_per_sample: float = 0.0  # device bytes one sample needs (activations + their grads); 0: no cap
    reserved_bytes: float = 0.0  # device bytes taken before any sample (parameters, grads, optimizer state)
    min_samples: int = 1  # every worker keeps at least this many samples, so its speed stays measurable

    def __post_init__(self) -> None:
        if self.window < 1:
            raise UserError(f"balance window must be >= 1 step, got {self.window}")
        if self.every < 1:
            raise UserError(f"balance every must be >= 1 step, got {self.every}")
        if self.memory_per_sample < 0 or self.reserved_bytes < 0:
            raise UserError("memory_per_sample and reserved_bytes must be >= 0 bytes")
        if self.min_samples < 0:
            raise UserError("min_samples must be >= 0")


def memory_caps(memory: list[float], cfg: BalanceConfig) -> np.ndarray:
    """Most samples each worker's free memory holds (a huge number when uncapped)."""
    huge = np.iinfo(np.int64).max // (4 * max(1, len(memory)))  # caps.sum() must not wrap either
    if cfg.memory_per_sample <= 0:
        return np.full(len(memory), huge, dtype=np.int64)
    free = np.maximum(0.0, np.asarray(memory, dtype=float) - cfg.reserved_bytes)
    # infinite memory (a worker without a cluster file) stays a huge count instead of wrapping when cast
    return np.floor(np.minimum(free / cfg.memory_per_sample, huge)).astype(np.int64)


def balanced_sizes(global_batch: int, speeds, caps, min_samples: int = 1, labels=None,
                   memory_per_sample: float = 0.0) -> np.ndarray:
    """Per-worker batch sizes that add up to `global_batch`, proportional to `speeds`
    (samples/s) where memory allows: water-filling gives a capped worker its cap and
    spreads the rest over the others by speed. Deterministic in its inputs.
    """
    speeds = np.asarray(speeds, dtype=float)
    caps = np.asarray(caps, dtype=np.int64)
    n = len(speeds)
    if caps.sum() < global_batch:
        labels = labels or [f"worker {i}" for i in range(n)]
        short = global_batch - int(caps.sum())
        per = ", ".join(f"{lab}: {int(c)}" for lab, c in zip(labels, caps))
        extra = f" ({short * memory_per_sample / 2**20:.1f} MiB)" if memory_per_sample > 0 else ""
        raise BatchDoesNotFitError(
            f"the global batch of {global_batch} samples does not fit in the cluster's memory: the workers hold "
            f"at most {int(caps.sum())} samples together ({per}); short by {short} samples{extra}. "
            "Lower the global batch, add workers or memory, or reduce the memory each sample needs.")
    floor = np.minimum(caps, min_samples if global_batch >= min_samples * n else 0)
    speeds = np.where(np.isfinite(speeds) & (speeds > 0), speeds, 0.0)
    if speeds.sum() <= 0:
        speeds = np.ones(n)
    # water-filling: sizes = clip(λ·speed, floor, cap) with λ chosen so they add up to the
    # global batch (the sum is monotone in λ: bisection); a capped worker keeps its cap
    # and the rest is spread over the others by speed
    def total(lam: float) -> float:
        return float(np.clip(lam * speeds, floor, caps).sum())

    lo, hi = 0.0, 1.0
    while total(hi) < global_batch and hi < 1e30:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) < global_batch else (lo, mid)
    sizes = np.clip(hi * speeds, floor, caps).astype(float)
    ints = np.minimum(np.floor(sizes + 1e-9).astype(np.int64), caps)
    short = global_batch - int(ints.sum())
    # the samples rounding left over go one by one to the worker that would finish its
    # step soonest with one more (minimises the slowest worker's step time)
    pace = np.where(speeds > 0, speeds, 1e-12)
    for _ in range(max(0, short)):
        after = np.where(ints < caps, (ints + 1) / pace, np.inf)
        ints[int(np.argmin(after))] += 1
    short = min(short, 0)
    over = ints - caps
    while short < 0 and (ints > floor).any():  # rounding gave one too many: take from the biggest surplus
        i = int(np.argmax(np.where(ints > floor, ints - sizes, -np.inf)))
        ints[i] -= 1
        short += 1
    while (over > 0).any():  # rounding pushed someone past a cap by one: move it to the most room
        i = int(np.argmax(over))
        j = int(np.argmax(np.where(ints < caps, caps - ints, -1)))
        ints[i] -= 1
        ints[j] += 1
        over = ints - caps
    return ints.astype(np.int64)


class Balancer:
    """Per-job balancer: `sizes` is this step's batch size for every worker.

    Call `record(samples, seconds)` after each step's compute and `update()` once per
    step (every worker, same step): speeds are exchanged and shares recomputed.
    """

    def __init__(self, ctx, global_batch: int, cfg: BalanceConfig | None = None, memory: list[float] | None = None):
        self.ctx = ctx
        self.cfg = cfg or BalanceConfig()
        self.n = ctx.num_workers
        self.global_batch = global_batch
        if memory is None:
            memory = [p.machine.device.memory for p in ctx.topology.workers] if ctx.topology else [float("inf")]
        self.labels = ctx.topology.worker_labels if ctx.topology else ["w0"]
        self.caps = memory_caps(memory, self.cfg)
        self._mine: deque = deque(maxlen=self.cfg.window)
        self.speeds = np.zeros(self.n)  # last agreed samples/s per worker (0 = not measured yet)
        self.step = 0
        self.sizes = balanced_sizes(global_batch, np.ones(self.n), self.caps, self.cfg.min_samples, self.labels,
                                    self.cfg.memory_per_sample)
        self.history: list[np.ndarray] = [self.sizes.copy()]

    def record(self, samples: int, seconds: float) -> None:
        """This worker's compute for the step just done."""
        if samples > 0 and seconds > 0:
            self._mine.append(samples / seconds)

    def my_speed(self) -> float:
        return float(np.median(self._mine)) if self._mine else 0.0

    def update(self) -> np.ndarray:
        """Exchange speeds and recompute the shares (a collective over the workers)."""
        self.step += 1
        if self.step % self.cfg.every:
            self.history.append(self.sizes.copy())
            return self.sizes
        mine = torch.tensor([self.my_speed()], dtype=torch.float64)
        if self.ctx.distributed and self.n > 1:
            out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.n)]
            try:
                dist.all_gather(out, mine, group=self.ctx.worker_group)
            except RuntimeError as err:
                raise self.ctx.peer_error("exchanging measured speeds", [], err) from None
            speeds = torch.cat(out).numpy()
        else:
            speeds = mine.numpy()
        # a worker not measured yet (e.g. an empty batch) counts at the mean measured speed
        known = speeds > 0
        if known.any():
            speeds = np.where(known, speeds, speeds[known].mean())
            self.speeds = speeds
            self.sizes = balanced_sizes(self.global_batch, speeds, self.caps, self.cfg.min_samples, self.labels,
                                        self.cfg.memory_per_sample)
        self.history.append(self.sizes.copy())
        return self.sizes


def estimate_memory_per_sample(model: torch.nn.Module, example: torch.Tensor) -> float:
    """Bytes of activations one sample produces in a forward pass (×2: their gradients),
    measured with forward hooks on the leaf modules for a batch of one."""
    total = [0]

    def hook(_m, _inp, out):
        if isinstance(out, torch.Tensor):
            total[0] += out.numel() * out.element_size()

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        with torch.no_grad():
            model(example[:1])
    finally:
        for h in handles:
            h.remove()
    return 2.0 * (total[0] + example[:1].numel() * example.element_size())
