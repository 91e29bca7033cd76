"""Watching one round of a job: what ended, what hangs, and which process is the root
cause. The watch only observes and reports (as torchrun's `_monitor_workers` returns a
`RunResult`); the leader (`leader.py`) decides what to do about it: record the culprit,
stop a hung process, wait out a grace period, restart or end the job.

Evidence: exits of this launcher's children, exits the other nodes' launchers posted
in the round's store, heartbeats in the store (every rank) and the kernel's process
state (this host's children, `heartbeat.Liveness`). The root cause of a failure is the
first process that died without having lost a peer, or one that stopped answering (no
heartbeat for the peer timeout, or stopped by a signal). A process that failed only
because it lost a peer is a consequence: the watch looks a while longer for the process
that died or hangs before blaming it."""
from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field

from ..heartbeat import Liveness
from ..rounds import COMMITS, read_exit
from ..topology import Proc, Topology
from .config import EXIT_RESIZE, EXIT_STOPPED
from .procs import Child, ProcessBackend, describe_exit, is_consequence

# a survivor failed because it lost a peer, and no root cause is known yet: look this
# long for the process that died or hangs before blaming the survivor itself
CONSEQUENCE_WAIT_S = 5.0
POLL_S = 0.5  # the store (heartbeats, other nodes' exits) is read this often
_CLEAN = (0, EXIT_STOPPED, EXIT_RESIZE)


class RoundOutcome(enum.Enum):
    """How a round ended."""

    DONE = "done"  # every process finished
    STOPPED = "stopped"  # stopped at a checkpoint on request (SIGUSR1)
    RESIZE = "resize"  # workers stopped at a commit so machines can join
    FAILED = "failed"  # a process died or hung (the culprit)


@dataclass(frozen=True)
class RootCause:
    """The process a failed round is blamed on: `kind` died or hung, and how/why."""

    rank: int
    kind: str  # "died" | "hung"
    how: str

    @property
    def record(self) -> str:
        """As stored for the survivors (`rounds.dead_key`): "died: how" | "hung: why"."""
        return f"{self.kind}: {self.how}"


@dataclass
class RoundResult:
    outcome: RoundOutcome = RoundOutcome.DONE
    culprit: Proc | None = None
    record: str = ""  # "died: how" | "hung: why"
    culprit_text: str = ""
    tail: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    commits: int = 0
    joining: list[str] = field(default_factory=list)


def joined(rstore, rank: int) -> bool:
    """Whether `rank` got past the rendezvous (hetrain.init() marks it in the round's
    store); True when the store cannot say, so the ordinary grace applies."""
    try:
        return bool(rstore.check([f"hetrain/joined/{rank}"]))
    except Exception:
        return True


class RoundWatch:
    """What this round's processes did so far. `collect` gathers evidence; `root_cause`
    says who is to blame (None while nobody is); `result` sums the round up."""

    def __init__(self, rstore, topo: Topology, children: list[Child], backend: ProcessBackend, hang_s: float):
        self.rstore, self.topo, self.backend, self.hang_s = rstore, topo, backend, hang_s
        self.suspect_s = min(hang_s, max(3.0, hang_s / 3))
        self.local = {c.proc.rank: c for c in children}
        self.remote = [p.rank for p in topo.procs if p.rank not in self.local]
        self.live = Liveness(rstore, [p.rank for p in topo.procs])
        for c in children:
            pid = backend.host_pid(c)
            if pid is not None:
                self.live.watch_pid(c.proc.rank, pid)
        self.exits: dict[int, tuple[int, bool]] = {}  # rank -> (exit code, failed only because it lost a peer)
        self.texts: dict[int, str] = {}  # how a process of this node ended, in words
        self._consequence_since: float | None = None
        self._next_poll = 0.0

    def how(self, rank: int) -> str:
        return self.texts.get(rank) or describe_exit(self.exits[rank][0])

    def collect(self, now: float) -> bool:
        """Take in what happened; returns True when the store was read this time (every
        `POLL_S`), so the caller can do its own store reading at the same pace."""
        for rank, c in self.local.items():
            if rank not in self.exits and c.popen.poll() is not None:
                if c.reader:
                    c.reader.join(timeout=2)  # its last lines decide whether it only lost a peer
                self.exits[rank] = (c.popen.returncode, is_consequence(c))
                self.texts[rank] = self.backend.exit_text(c)
                self.live.forget(rank)
        if now < self._next_poll:
            return False
        self._next_poll = now + POLL_S
        self.live.poll()
        for rank in self.remote:
            if rank not in self.exits:
                e = read_exit(self.rstore, rank)
                if e is not None:
                    self.exits[rank] = e
                    self.live.forget(rank)
        return True

    def mark_lost(self, node: int) -> None:
        """A node's launcher stopped answering: its processes count as killed."""
        for p in self.topo.procs:
            if p.machine.node == node and p.rank not in self.exits:
                self.exits[p.rank] = (-signal.SIGKILL, False)
                self.live.forget(p.rank)

    def root_cause(self, now: float) -> RootCause | None:
        """The process to blame, if there is one yet: a real death first, then a hang,
        and for a process that only lost a peer, a suspect silent for `suspect_s`, or,
        after `CONSEQUENCE_WAIT_S` with none, the lowest failed rank."""
        failed = {k: e for k, e in self.exits.items() if e[0] not in _CLEAN}
        real = [k for k, (_, cons) in failed.items() if not cons]  # in the order they were seen
        hung = self.live.hung(self.hang_s)
        if real:
            return RootCause(real[0], "died", self.how(real[0]))
        if hung:
            return RootCause(hung[0], "hung", self.live.reason(hung[0]))
        if failed:
            self._consequence_since = self._consequence_since or now
            suspects = self.live.hung(self.suspect_s)
            if suspects:
                return RootCause(suspects[0], "hung", self.live.reason(suspects[0]))
            if now - self._consequence_since > CONSEQUENCE_WAIT_S:
                k = min(failed)
                return RootCause(k, "died", self.how(k))
        return None

    @property
    def workers_ended(self) -> bool:
        return all(w in self.exits for w in self.topo.worker_ranks)

    def never_joined(self) -> bool:
        """Every worker ended cleanly without joining the job (the script never called
        hetrain.init()) while servers still run: they would wait for it forever."""
        ranks = self.topo.worker_ranks
        return (all(self.exits[w][0] in (0, EXIT_STOPPED) for w in ranks) and len(self.exits) < len(self.topo.procs)
                and not any(joined(self.rstore, w) for w in ranks))

    def servers_done(self) -> None:
        """Count the processes still running as finished (stopped after the workers ended)."""
        for k in range(len(self.topo.procs)):
            if k not in self.topo.worker_ranks:
                self.exits[k] = (0, False)

    @property
    def all_ended(self) -> bool:
        return len(self.exits) == len(self.topo.procs)

    def result(self, root: RootCause | None, names: list[str], joining: list[str]) -> RoundResult:
        """The round's outcome once it is over."""
        for c in self.local.values():
            if c.reader:
                c.reader.join(timeout=5)
        failed = {k: e for k, e in self.exits.items() if e[0] not in (*_CLEAN, -signal.SIGTERM)}
        if root is None and failed:
            k = min(failed, key=lambda k: (failed[k][1], k))
            root = RootCause(k, "died", self.how(k))
        try:
            commits = int(self.rstore.add(COMMITS, 0))
        except Exception:
            commits = 0
        res = RoundResult(names=names, commits=commits, joining=joining)
        if root is not None:
            res.outcome, res.culprit, res.record = RoundOutcome.FAILED, self.topo.proc(root.rank), root.record
            lead = "stopped answering: " if root.kind == "hung" else ""
            res.culprit_text = f"{self.topo.describe(root.rank)} ({lead}{root.how})"
            res.tail = list(self.local[root.rank].tail) if root.rank in self.local else []
        else:
            codes = {e[0] for e in self.exits.values()}
            res.outcome = (RoundOutcome.RESIZE if EXIT_RESIZE in codes else
                           RoundOutcome.STOPPED if EXIT_STOPPED in codes else RoundOutcome.DONE)
        return res
