"""Every placement planner by name, for the CLI, the job planner and the benches.

The planners are listed here rather than registering themselves into `base.py`: a base
that had to import its subclasses' modules to fill a registry imported them back, a
cycle; this module stands above them all.
"""
from __future__ import annotations

from ..errors import UserError
from .base import Planner
from .baselines import AllCheapestCPU, AllCheapestGPU, Genetic, GreedyPerLayer
from .exact import ExactPlanner
from .rl import RLPlanner

PLANNERS: dict[str, type[Planner]] = {
    c.name: c for c in (ExactPlanner, RLPlanner, Genetic, GreedyPerLayer, AllCheapestGPU, AllCheapestCPU)}


def get_planner(name: str, **kwargs) -> Planner:
    """A new planner of that name, with its options (`kwargs`)."""
    if name not in PLANNERS:
        raise UserError(f"unknown planner {name!r}; choose one of {planner_names()}")
    return PLANNERS[name](**kwargs)


def planner_names() -> list[str]:
    return sorted(PLANNERS)
