"""The planner interface: a `Problem` in, a scored plan out; planners by name."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..errors import UserError
from ..perf.pipeline import CostParams, PlanScore, StageTables, Workload, evaluate, run_cost, stage_tables


@dataclass
class Problem:
    """Place the layers of ``workload`` to sustain ``target`` samples/s at least cost."""

    workload: Workload
    target: float
    params: CostParams = field(default_factory=CostParams)
    n_samples: float = 1e8      # samples in the training run that is priced

    def __post_init__(self) -> None:
        if not (np.isfinite(self.target) and self.target > 0):
            raise UserError(f"throughput target must be a positive number of samples/s, got {self.target}")
        if not self.n_samples > 0:
            raise UserError(f"the number of samples in the run must be > 0, got {self.n_samples}")

    @cached_property
    def tables(self) -> StageTables:
        return stage_tables(self.workload, self.target, self.params)

    def evaluate(self, assignment) -> PlanScore:
        return evaluate(self.workload, assignment, self.target, self.params)

    def run_cost(self, score: PlanScore) -> float:
        return run_cost(score.hourly, self.n_samples, self.target)

    def run_cost_hourly(self, hourly: float) -> float:
        return run_cost(hourly, self.n_samples, self.target)

    def with_target(self, target: float) -> "Problem":
        return Problem(self.workload, target, self.params, self.n_samples)


@dataclass
class PlanResult:
    planner: str
    score: PlanScore
    plan_s: float
    info: dict = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.score.feasible


class Planner:
    """Subclasses set ``name`` (their name in `hetrain.plan.planners`) and implement
    ``solve(problem) -> (assignment, info)``."""

    name = "planner"

    def solve(self, problem: Problem) -> tuple[tuple[int, ...] | None, dict]:  # pragma: no cover
        raise NotImplementedError

    def plan(self, problem: Problem) -> PlanResult:
        t0 = time.perf_counter()
        assignment, info = self.solve(problem)
        dt = time.perf_counter() - t0
        if assignment is None:
            score = PlanScore((), (), 0.0, float("inf"), False, info.get("reason", "no feasible plan found"))
        else:
            score = problem.evaluate(assignment)
        return PlanResult(self.name, score, dt, info)
