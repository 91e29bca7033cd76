"""What a real-device run pays beyond the per-layer profile, for `measure_real`
(pipeline/measure.py): the micro-batch size the run uses, each device type's measured
cost of running a stage as the runtime does, and the pipeline's fill and drain.

* **Micro-batch size.** A GPU stage pays a fixed cost per micro-batch (its kernel
  launches and the Python around them), so at micro-batches that are small for it a GPU
  prices a small model at no better than a few CPU threads. Every stage of a run uses the
  same micro-batch (batch / micro-batches), so the run's count is chosen among a few, each
  profiled on every type: the one whose best plan reaches the highest throughput
  (`choose_micro_batches`), and the profile used to plan is the one measured at it.
* **Per type, the run's own cost.** A one-stage plan of each type is run first (the
  calibration runs: all-GPU, all-CPU). The ratio of its predicted to its measured
  throughput is what that type's processes pay beyond the profile at this micro-batch
  (per-micro-batch messages, the sparse-PS pulls over the network, the step boundary's
  optimizer and shard update, cores shared with the shards); the type's layer times are
  scaled by it (`scaled_profile`) before the plan that is checked is made. The check is
  then on a plan the calibration runs never ran (a multi-stage placement).
* **Fill and drain.** A synchronous pipeline step starts empty: besides the bottleneck
  stage's share of the batch, a step waits about one micro-batch of every other stage
  (forward fill plus backward drain, `fill_drain_s`), which the steady-state cost model
  leaves out.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from ..errors import UserError
from ..perf.pipeline import CostParams, PlanScore
from ..plan.base import Problem
from ..plan.exact import max_throughput
from ..plan.profile import ModelProfile


def micro_batch_choices(batch: int, wanted: int, replicas: int = 1, spread: tuple[int, ...] = (1, 4, 16)) -> list[int]:
    """Micro-batch counts to try: `wanted` and `wanted` / 4, / 16, each rounded up to a
    multiple of every replica count up to `replicas` (so the runtime keeps the count
    whatever the plan's replicas, `spec.lcm_micro_batches`, and the micro-batch stays the
    one profiled), at most `batch`; largest count first, without repeats."""
    if wanted < 1 or batch < 1 or replicas < 1:
        raise UserError(f"micro-batches ({wanted}), batch ({batch}) and replicas ({replicas}) must be >= 1")
    step = math.lcm(*range(1, replicas + 1))
    out = []
    for d in spread:
        c = min(batch, math.ceil(max(min(2, wanted), wanted // d) / step) * step)
        if c not in out:
            out.append(c)
    return sorted(out, reverse=True)


def best_reachable(profile: ModelProfile, catalogue, batch: int, micro_batches: int) -> float:
    """Highest throughput any placement of `profile` on `catalogue` reaches (the cost model),
    with the fill and drain of its steps at `micro_batches` per step."""
    problem = Problem(profile.workload(catalogue), 1.0, CostParams(batch_size=batch))
    top, a = max_throughput(problem)
    if a is None or top <= 0:
        return 0.0
    score = problem.with_target(top * (1 - 1e-6)).evaluate(a)
    return with_fill_drain(score.throughput, batch, score, batch // micro_batches)


def choose_micro_batches(profiles: Mapping[int, ModelProfile], catalogue, batch: int) -> tuple[int, dict[int, float]]:
    """The micro-batch count (a key of `profiles`, each profiled at batch / count) whose
    best plan is fastest, fill and drain included; within 2% the larger count wins.
    Returns it and every count's best reachable throughput."""
    if not profiles:
        raise UserError("no profile to choose a micro-batch size from")
    best = {c: best_reachable(p, catalogue, batch, c) for c, p in profiles.items()}
    top = max(best.values())
    return max(c for c, v in best.items() if v >= 0.98 * top), best


def type_factor(predicted_sps: float, measured_sps: float) -> float:
    """How many times the profile's time per sample a type's one-stage run took."""
    if not (predicted_sps > 0 and measured_sps > 0):
        raise UserError(f"a calibration run needs positive throughputs, got predicted {predicted_sps}, "
                        f"measured {measured_sps}")
    return predicted_sps / measured_sps


def scaled_profile(profile: ModelProfile, factors: Mapping[str, float]) -> ModelProfile:
    """`profile` with each measured type's layer times multiplied by its factor (types
    without one unchanged; the reference `time_s` follows its type where it has one)."""
    unknown = sorted(set(factors) - set(profile.measured))
    if unknown:
        raise UserError(f"factors for types {unknown} that the profile has no measured times for "
                        f"({sorted(profile.measured)})")
    measured = {t: tuple(x * factors.get(t, 1.0) for x in times) for t, times in profile.measured.items()}
    ref = next((t for t, times in profile.measured.items()
                if list(times) == [l.time_s for l in profile.layers]), None)
    layers = profile.layers
    if ref is not None:
        layers = tuple(l.model_copy(update={"time_s": t}) for l, t in zip(layers, measured[ref]))
    return profile.model_copy(update={"measured": measured, "layers": layers})


def fill_drain_s(score: PlanScore, micro_batch: int) -> float:
    """Seconds a synchronous step adds to the steady state: one micro-batch through every
    stage but the bottleneck (forward fill and backward drain), on one instance each."""
    if not score.stages:
        return 0.0
    slowest = min(range(len(score.stages)), key=lambda s: score.stages[s].throughput)
    return sum(micro_batch * st.time_per_sample for s, st in enumerate(score.stages) if s != slowest)


def with_fill_drain(throughput: float, batch: int, score: PlanScore, micro_batch: int) -> float:
    """Samples/s of steps of `batch` samples at the steady-state `throughput` plus the fill
    and drain."""
    if throughput <= 0:
        return 0.0
    return batch / (batch / throughput + fill_drain_s(score, micro_batch))


def gpu_target(best: float, cpu_only_best: float, share: float = 0.5) -> float:
    """A throughput target a plan meets only with the GPU where it helps: halfway between
    what the CPU types reach alone and the best any plan reaches; `share` of the best
    where the GPU adds less than 5%."""
    if best > 1.05 * cpu_only_best > 0:
        return 0.5 * (cpu_only_best + best)
    return share * best
