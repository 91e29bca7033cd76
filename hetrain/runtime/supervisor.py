"""Who takes part in the next round of an elastic job, and whether there is one.

Pure bookkeeping (no processes, no store), so the policy is testable in-process; the
launcher feeds it what it observed and asks it which machines to start next.

A *round* is one start of the job's processes on a set of machines. A round ends
because it finished, was stopped on request, hit a failure (a process died or hung),
or was asked to resize at a commit so that a machine can come back. After a failure
the next round starts from the last commit on the machines still in; a machine whose
processes were the root cause of two failures in a row is *left out*, and is tried
again once it is *healthy again*:

- embedded cluster (one host): a cool-down has passed since it was left out
  (`rejoin_after_s`, doubled each time the same machine is left out again, at most
  `max_cooldown_s`) and its emulated link is up (network namespaces) — there is no
  other independent evidence of health for a machine that is a slice of this host;
- multi-node: the node's launcher is connected (it joined with the job secret and its
  heartbeat is fresh) and, for a machine left out for failing, the cool-down passed.
  A node whose launcher vanished is out at once (nothing runs there) and back as soon
  as its launcher reconnects.

A machine's count of failures in a row goes back to 0 once it took part in a round
that made progress (committed at least once) without being the cause of its end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..cluster.spec import ClusterSpec
from ..errors import UserError

FAILURES_TO_LEAVE_OUT = 2


@dataclass(frozen=True)
class ElasticConfig:
    """The launcher's restart policy (`--max-restarts`, `--min-workers`, `--rejoin-after`)."""

    max_restarts: int = 0  # failures the job survives (torchrun's meaning); resizes do not count
    min_workers: int = 1  # give up when fewer worker machines than this are left
    rejoin_after_s: float = 60.0  # cool-down before a left-out machine is tried again
    max_cooldown_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.min_workers < 1:
            raise UserError(f"--min-workers must be >= 1, got {self.min_workers}")
        if self.rejoin_after_s < 0:
            raise UserError(f"--rejoin-after must be >= 0 seconds, got {self.rejoin_after_s}")

    @property
    def elastic(self) -> bool:
        return self.max_restarts > 0


@dataclass
class MachineHealth:
    name: str
    node: int
    role: str
    failures_in_row: int = 0
    left_out_at: float | None = None  # None: in
    cooldown_s: float = 0.0
    times_left_out: int = 0
    reason: str = ""


@dataclass
class Membership:
    """Health of every machine of the cluster file, and which of them run next."""

    cluster: ClusterSpec
    cfg: ElasticConfig = field(default_factory=ElasticConfig)
    clock: Callable[[], float] = time.monotonic
    probe: Callable[[str], bool] = lambda name: True  # extra health check (link up...)

    def __post_init__(self) -> None:
        self.machines = {m.name: MachineHealth(m.name, m.node, m.role) for m in self.cluster.machines}
        self.nodes_connected: dict[int, bool] = {n: True for n in range(self.cluster.nnodes)}

    # ---- what runs next -------------------------------------------------------------
    def included(self) -> list[str]:
        """Machines of the next round, in cluster-file order."""
        return [m.name for m in self.cluster.machines
                if self.machines[m.name].left_out_at is None and self.nodes_connected[m.node]]

    def left_out(self) -> list[str]:
        return [n for n in self.machines if n not in self.included()]

    def next_cluster(self) -> ClusterSpec:
        names = self.included()
        if not any(self.machines[n].role == "worker" for n in names):
            raise UserError("no worker machine is left to run the job on")
        return self.cluster.subset(names)

    # ---- what happened --------------------------------------------------------------
    def blame(self, name: str, why: str) -> str | None:
        """`name`'s processes caused a round to fail. Returns a message if it is now
        left out."""
        h = self.machines[name]
        h.failures_in_row += 1
        h.reason = why
        if h.failures_in_row >= FAILURES_TO_LEAVE_OUT and h.left_out_at is None:
            h.left_out_at = self.clock()
            h.cooldown_s = min(self.cfg.max_cooldown_s, self.cfg.rejoin_after_s * 2 ** h.times_left_out)
            h.times_left_out += 1
            return (f"machine {name} caused {h.failures_in_row} failures in a row; the job goes on without it and "
                    f"tries it again after {h.cooldown_s:.0f} s")
        return None

    def progressed(self, names: list[str], culprit: str | None) -> None:
        """A round on `names` committed at least once: their failure streaks end
        (except the culprit's, whose failure ended the round)."""
        for n in names:
            if n != culprit:
                self.machines[n].failures_in_row = 0

    def node_lost(self, node: int) -> None:
        self.nodes_connected[node] = False

    def node_back(self, node: int) -> None:
        self.nodes_connected[node] = True

    # ---- growing back ---------------------------------------------------------------
    def ready_to_return(self) -> list[str]:
        """Left-out machines that are healthy again (see the module docstring)."""
        now = self.clock()
        back = []
        for h in self.machines.values():
            if h.left_out_at is None or not self.nodes_connected[h.node]:
                continue
            if now - h.left_out_at >= h.cooldown_s and self.probe(h.name):
                back.append(h.name)
        return back

    def readmit(self, names: list[str]) -> None:
        """Take machines back in. One more failure leaves them out again (with a
        longer cool-down): their streak stays one short of the limit."""
        for n in names:
            h = self.machines[n]
            h.left_out_at = None
            h.failures_in_row = FAILURES_TO_LEAVE_OUT - 1
