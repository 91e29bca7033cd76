"""Cores of their own for CPU workers (`threads: N` on a worker machine).

A worker machine that declares `threads: N` gets N cores of its host that no other
pinned worker gets; its process is pinned to them (sched_setaffinity, set before the
training script starts) and runs N torch threads (OMP_NUM_THREADS, and
torch.set_num_threads in `hetrain.init()`), so workers do not steal each other's cores.
The summation servers and the workers without `threads` share the cores left over
(all of them when none are left). Everything is checked before any process starts.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

from ..errors import UserError
from .topology import Proc

# Runs before the real command: pin, then exec it (same pid, so the launcher's process
# handling is unchanged). A wrapper rather than Popen's preexec_fn, which is unsafe in
# a process with threads (the launcher's output readers).
_PIN = "import os,sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); os.execv(sys.argv[2], sys.argv[2:])"


@dataclass(frozen=True)
class CorePlan:
    pinned: dict[int, tuple[int, ...]]  # rank -> its own cores
    rest: tuple[int, ...] | None  # cores for every other process; None: leave them unpinned

    def cores_for(self, rank: int) -> tuple[int, ...] | None:
        return self.pinned.get(rank, self.rest)

    def threads_for(self, rank: int) -> int | None:
        cores = self.pinned.get(rank)
        return len(cores) if cores else None


def _ranges(cores: Sequence[int]) -> str:
    """0,1,2,5 -> '0-2,5' (how a person reads a CPU list)."""
    out, start, prev = [], None, None
    for c in sorted(cores):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = c
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ",".join(out)


def assign_cores(procs: Sequence[Proc], available: Sequence[int]) -> CorePlan:
    """Give each worker process of a machine with `threads: N` its own N cores.

    `procs` are the processes one launcher starts on its host, `available` the cores it
    may use (its own affinity). Cores go out in rank order, as consecutive blocks of
    CPU ids (on Linux, consecutive ids are usually distinct physical cores before the
    SMT siblings). Raises UserError, saying what to change, when they do not fit.
    """
    cores = sorted(set(available))
    asks = [(p, p.machine.threads) for p in procs if p.role == "worker" and p.machine.threads]
    if not asks:
        return CorePlan({}, None)
    have = f"{len(cores)} core(s) (CPUs {_ranges(cores)})"
    for p, n in asks:
        if n > len(cores):
            raise UserError(f"machine {p.machine.name} asks for threads: {n}, but this host has {have} for the job; "
                            f"lower its `threads:` to at most {len(cores)}")
    total = sum(n for _, n in asks)
    if total > len(cores):
        per = ", ".join(f"{p.machine.name}: {n}" for p, n in asks)
        raise UserError(f"the worker machines this host runs ask for {total} cores together ({per}), but it has "
                        f"{have}; lower their `threads:` so they add up to at most {len(cores)}, or put some "
                        "machines on another node (`node:`)")
    pinned, at = {}, 0
    for p, n in asks:
        pinned[p.rank] = tuple(cores[at:at + n])
        at += n
    rest = tuple(cores[at:]) or None
    return CorePlan(pinned, rest)


def pin(argv: list[str], cores: Sequence[int]) -> list[str]:
    """`argv` started pinned to `cores` (argv[0] must be an executable path)."""
    return [sys.executable, "-S", "-c", _PIN, ",".join(map(str, cores)), *argv]


def describe(plan: CorePlan, procs: Sequence[Proc]) -> str:
    """One line for the launcher's log: who got which cores."""
    parts = [f"{p.label}: {_ranges(plan.pinned[p.rank])}" for p in procs if p.rank in plan.pinned]
    rest = _ranges(plan.rest) if plan.rest else "all (none left over)"
    return f"cores: {'; '.join(parts)}; other processes: {rest}"
