"""Memory and step time of sharded data parallelism (ZeRO stages 0-3 with uneven shards),
numpy only: what `hetrain.train.shard` holds on each worker, predicted item by item, and
the planner that picks the fastest stage that fits every worker.

Per worker i, for a model of N elements in units (top-level modules) of at most U
elements, p bytes an element, s optimizer-state bytes an element (Adam: 8), a share f_i
of every unit's elements (its *memory weight*) and b_i samples of the batch:

    item                stage 0      stage 1      stage 2        stage 3
    parameters          N·p          N·p          N·p            f·N·p + 2·U·p   (own span + gathered unit and the one prefetched)
    gradients           N·p          N·p          f·N·p + 3·U·p  f·N·p + 3·U·p   (owned span + one unit's grads, its flat copy and the one being reduced)
    optimizer state     N·s          f·N·s        f·N·s          f·N·s
    optimizer scratch   2·U·p        2·f·U·p      2·f·U·p        2·f·U·p         (the step's temporaries: one tensor's, two wide)
    communication       U·p          U·p          (in gradients) (in gradients)  (stage 0/1: one unit's flat gradient)
    activations         b·a          b·a          b·a            b·a
    build               -            -            -              N·p + U·p       (the full model before it is sharded)

and the peak is the larger of the build and the sum of the others (they coincide at the
end of backward). `whole_bytes` is what a worker holds whatever its share; weights by
memory give each worker a share of the rest proportional to its room (`shares_by_memory`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from ..errors import UserError  # dependency-free: perf stays numpy-only

Stage = Literal[0, 1, 2, 3]
STAGES: tuple[int, ...] = (0, 1, 2, 3)


@dataclass(frozen=True)
class ShardModel:
    """What the memory model needs of a model: its units' sizes and the optimizer."""

    name: str
    unit_numels: tuple[int, ...]
    act_bytes_per_sample: float = 0.0
    elem_bytes: int = 4                 # fp32 parameters and gradients
    state_bytes_per_elem: int = 8       # Adam: exp_avg + exp_avg_sq

    @property
    def numel(self) -> int:
        return int(sum(self.unit_numels))

    @property
    def largest_unit(self) -> int:
        return int(max(self.unit_numels)) if self.unit_numels else 0

    @property
    def state_bytes(self) -> float:
        """A replica plus its optimizer state: parameters, gradients, state."""
        return float(self.numel * (2 * self.elem_bytes + self.state_bytes_per_elem))


@dataclass(frozen=True)
class ShardWorker:
    """A member of the job. A CPU machine as a memory and optimizer tier is a member with
    `per_sample_s` inf: no samples, a span of every unit by its (large) memory, the step
    of that span applied on its CPU."""

    name: str
    memory: float                 # bytes this worker may use for training (its cap)
    per_sample_s: float           # compute seconds per sample (inf: the CPU tier)
    bandwidth: float = 1e9        # bytes/s each way reached by the collectives
    builds_elsewhere: bool = False  # the model is built on the host and sharded onto this device


def memory_items(model: ShardModel, stage: int, share: float, batch: float) -> dict[str, float]:
    """The predicted bytes of each item on a worker owning `share` of every unit."""
    if stage not in STAGES:
        raise UserError(f"stage {stage!r} is not one of {STAGES}")
    n, u, p, s = model.numel, model.largest_unit, model.elem_bytes, model.state_bytes_per_elem
    f = 1.0 if stage == 0 else float(share)
    items = {
        "parameters": n * p if stage < 3 else f * n * p + 2 * u * p,
        "gradients": n * p if stage < 2 else f * n * p + 3 * u * p,
        "optimizer state": f * n * s,
        "optimizer scratch": 2 * f * u * p,
        "communication": u * p if stage < 2 else 0.0,
        "activations": float(batch) * model.act_bytes_per_sample,
    }
    return {k: float(v) for k, v in items.items()}


def build_bytes(model: ShardModel, stage: int, elsewhere: bool = False) -> float:
    """The peak while a stage-3 model is sharded: the whole model plus one flat unit (a
    model built elsewhere and sharded onto this device: one unit and its span)."""
    if stage != 3:
        return 0.0
    return float((model.largest_unit if elsewhere else model.numel) + model.largest_unit) * model.elem_bytes


def peak_bytes(model: ShardModel, stage: int, share: float, batch: float, elsewhere: bool = False) -> float:
    return max(sum(memory_items(model, stage, share, batch).values()), build_bytes(model, stage, elsewhere))


def whole_bytes(model: ShardModel, stage: int, batch: float, elsewhere: bool = False) -> float:
    """What a worker holds whatever its share (all but the share-proportional items)."""
    return peak_bytes(model, stage, 0.0 if stage > 0 else 1.0, batch, elsewhere)


def sharded_bytes(model: ShardModel, stage: int) -> float:
    """The bytes split among the workers (f = 1): per element s, + p from stage 2, + p at 3."""
    per = model.state_bytes_per_elem + model.elem_bytes * ((stage >= 2) + (stage >= 3))
    return float(model.numel * per) if stage > 0 else 0.0


def shares_by_memory(free_bytes: Sequence[float], activation_bytes: Sequence[float],
                     whole: Sequence[float] | float = 0.0, floor: float = 0.0) -> list[float]:
    """Memory weights: what each worker has left for the sharded state once the
    activations of its batch share and what it keeps whole (`whole`) are counted. A
    worker with no room left gets `floor` (0: it owns no span). Raises when none has room."""
    n = len(free_bytes)
    if len(activation_bytes) != n:
        raise UserError(f"{n} free-memory figures but {len(activation_bytes)} activation figures; give one per worker")
    wh = [float(whole)] * n if isinstance(whole, (int, float)) else [float(x) for x in whole]
    room = [max(float(floor), float(f) - float(a) - w) for f, a, w in zip(free_bytes, activation_bytes, wh)]
    if sum(room) <= 0:
        worst = max(range(n), key=lambda i: float(activation_bytes[i]) + wh[i] - float(free_bytes[i]))
        raise UserError(f"no worker has memory left for the sharded state: worker {worst} has "
                        f"{float(free_bytes[worst]) / 2**20:.1f} MiB free but needs "
                        f"{(float(activation_bytes[worst]) + wh[worst]) / 2**20:.1f} MiB for activations and "
                        "whole buffers; lower the batch or use a higher stage")
    return room


def batch_shares(workers: Sequence[ShardWorker], global_batch: int) -> np.ndarray:
    """Samples per worker proportional to speed (largest remainder, summing to the batch);
    a CPU-tier member (`per_sample_s` inf: it trains on nothing) gets none."""
    speed = np.array([0.0 if np.isinf(w.per_sample_s) else 1.0 / w.per_sample_s for w in workers])
    if speed.sum() <= 0:
        raise UserError("no worker trains on samples (every per_sample_s is inf); give at least one a finite time")
    ideal = global_batch * speed / speed.sum()
    b = np.floor(ideal).astype(int)
    for i in np.argsort(-(ideal - b), kind="stable")[: global_batch - int(b.sum())]:
        b[i] += 1
    return b


def comm_bytes(model: ShardModel, stage: int, n: int) -> float:
    """Bytes each worker moves per step: all-reduce 2(n-1)/n·M (stage 0-1, + the params'
    all-gather at 1), reduce + gather (n-1)/n·M each (2), + the backward's re-gather (3)."""
    m = model.numel * model.elem_bytes * (n - 1) / max(n, 1)
    return float({0: 2 * m, 1: 3 * m, 2: 2 * m, 3: 3 * m}[stage])


@dataclass(frozen=True)
class ShardPlan:
    stage: int
    batch: tuple[int, ...]
    weights: tuple[float, ...]          # memory weights (shares of every unit)
    peak: tuple[float, ...]             # predicted peak bytes per worker
    items: tuple[dict, ...]             # per worker: item -> bytes
    step_s: float
    why: str
    rejected: dict = field(default_factory=dict)  # stage -> why it does not fit

    @property
    def shares(self) -> tuple[float, ...]:
        t = sum(self.weights)
        return tuple(w / t for w in self.weights)


def plan_stage(model: ShardModel, workers: Sequence[ShardWorker], global_batch: int, stage: int,
               even: bool = False) -> ShardPlan:
    """One stage's plan: batch by speed (equal if `even`), spans by memory (equal if `even`)."""
    n = len(workers)
    batch = np.full(n, global_batch // n) if even else batch_shares(workers, global_batch)
    if even:
        batch[: global_batch - int(batch.sum())] += 1
    if stage == 0 or even:
        weights = [1.0] * n
    else:
        whole = [whole_bytes(model, stage, b, w.builds_elsewhere) for b, w in zip(batch, workers)]
        try:
            weights = shares_by_memory([w.memory for w in workers], [0.0] * n, whole)
        except UserError:
            weights = [1.0] * n  # nobody has room: even spans, which the check below refuses
    total = sum(weights)
    shares = [w / total for w in weights]
    items = tuple(memory_items(model, stage, f, b) for f, b in zip(shares, batch))
    peak = tuple(peak_bytes(model, stage, f, b, w.builds_elsewhere) for f, b, w in zip(shares, batch, workers))
    compute = max(b * w.per_sample_s for b, w in zip(batch, workers) if b > 0)
    comm = comm_bytes(model, stage, n) / min(w.bandwidth for w in workers) if n > 1 else 0.0
    return ShardPlan(stage, tuple(int(b) for b in batch), tuple(float(w) for w in weights), peak, items,
                     float(compute + comm), "")


def _overflow(plan: ShardPlan, workers: Sequence[ShardWorker]) -> tuple[float, int]:
    over = [p - w.memory for p, w in zip(plan.peak, workers)]
    i = int(np.argmax(over))
    return over[i], i


def choose_plan(model: ShardModel, workers: Sequence[ShardWorker], global_batch: int,
                stages: Sequence[int] = STAGES) -> ShardPlan:
    """The fastest stage whose predicted peak fits every worker; a UserError naming the
    largest item and the worker it overflows when none fits."""
    plans = {s: plan_stage(model, workers, global_batch, s) for s in stages}
    fits = {s: p for s, p in plans.items() if _overflow(p, workers)[0] <= 0}
    rejected = {}
    for s, p in plans.items():
        if s not in fits:
            over, i = _overflow(p, workers)
            rejected[s] = f"{workers[i].name} over by {over / 2**20:.1f} MiB"
    if not fits:
        stage = min(plans, key=lambda s: _overflow(plans[s], workers)[0])
        over, i = _overflow(plans[stage], workers)
        items = plans[stage].items[i]
        big = max(items, key=items.get)
        raise UserError(
            f"no sharding plan fits: even at stage {stage} (the least memory) worker {workers[i].name} needs "
            f"{plans[stage].peak[i] / 2**20:.1f} MiB but has {workers[i].memory / 2**20:.1f} MiB; its largest item "
            f"is {big} ({items[big] / 2**20:.1f} MiB). Add workers or memory, or lower the batch "
            f"({global_batch} samples)")
    best = min(fits, key=lambda s: (fits[s].step_s, -s))
    p = fits[best]
    why = (f"stage {best}: the fastest that fits every worker (predicted step {p.step_s * 1e3:.0f} ms)"
           + ("; not fitting: " + ", ".join(f"stage {s}: {r}" for s, r in sorted(rejected.items()))
              if rejected else ""))
    return ShardPlan(p.stage, p.batch, p.weights, p.peak, p.items, p.step_s, why, rejected)
