"""Scheduling policies. Every policy has the same signature, used by the simulator
and the live executor alike:

    policy(jobs, cluster, allocation, now) -> allocation

`jobs` are the active jobs (arrived, unfinished; `remaining` is current), `allocation`
maps job_id -> Alloc(type, n) for the jobs that hold GPUs now, and the result is the
new allocation (absent = no GPUs). Policies are pure functions of their arguments.
"""
from __future__ import annotations

from ...errors import UserError
from .base import _REGISTRY, DEFAULT_POLICY, Policy, check_allocation

__all__ = ["DEFAULT_POLICY", "Policy", "check_allocation", "get_policy", "policy_names"]


def get_policy(name: str) -> Policy:
    """The policy of that name (its module is loaded at the first call)."""
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown policy {name!r}; choose one of {', '.join(policy_names())}") from None


def policy_names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def _load_all() -> None:
    from . import adaptive, doubling, fifo, gavel, goodput, optimal, sia, srtf  # noqa: F401  (they register themselves in base.py)
