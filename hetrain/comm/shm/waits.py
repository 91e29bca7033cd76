"""Waiting on a peer's control counter without hanging on a dead one.

The control channel is a few int64 counters in each segment's header (segment.py); a
process waits for a peer's counter to reach a round number. No futex, no socket: spin
for a few microseconds (a peer on another core is usually there already), then yield
the core, then sleep in growing steps up to a millisecond (with more processes than
cores, a spinning waiter would steal the core of the peer it waits for).

While it waits it watches its peers: every `CHECK_S` it reads each one's process state
in /proc (its pid is in its segment's header; a SIGKILLed process is gone, or a zombie
until the launcher reaps it) and asks `lost()` (the launcher's records of dead and hung
ranks, where the job has a launcher). A dead peer is named at once, well within the
heartbeat time; a peer that never arrives fails the wait after `timeout_s`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ...runtime.heartbeat import proc_state

CHECK_S = 0.25
SPIN = 200


class ShmPeerError(RuntimeError):
    """A peer of a shared-memory group died or never arrived; `ranks` names it."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


def gone(pid: int) -> bool:
    """Whether the local process `pid` has ended (gone, or a zombie not yet reaped)."""
    return proc_state(pid) in (None, "Z", "X")


class Waiter:
    """Waits on counters of the group's segments. `ranks[i]` and `pids[i]` are the job
    rank and process of segment i; `lost()` returns ranks known to be dead or hung."""

    def __init__(self, ranks: Sequence[int], pids: Sequence[int], timeout_s: float,
                 lost: Callable[[], list[int]] | None = None):
        self.ranks = list(ranks)
        self.pids = list(pids)
        self.timeout_s = timeout_s
        self.lost = lost

    def until(self, segments, which: int, value: int, what: str, skip: int | None = None) -> None:
        """Wait until every segment's counter `which` is at least `value` (but `skip`'s)."""
        waiting = [i for i in range(len(segments)) if i != skip and segments[i].counter(which) < value]
        if not waiting:
            return
        start = time.monotonic()
        check_at = start + CHECK_S
        spins, nap = 0, 0.0
        while waiting:
            waiting = [i for i in waiting if segments[i].counter(which) < value]
            if not waiting:
                return
            spins += 1
            if spins < SPIN:
                continue
            now = time.monotonic()
            if now >= check_at:
                self._check(waiting, what, now - start)
                check_at = now + CHECK_S
            if now - start < 1e-3:
                time.sleep(0)  # yield the core
            else:
                nap = min(1e-3, max(2e-5, nap * 2))
                time.sleep(nap)

    def _check(self, waiting: list[int], what: str, waited: float) -> None:
        dead = [self.ranks[i] for i in waiting if gone(self.pids[i])]
        if not dead and self.lost is not None:
            lost = set(self.lost())
            dead = [self.ranks[i] for i in waiting if self.ranks[i] in lost]
        if dead:
            who = ", ".join(f"rank {r}" for r in dead)
            raise ShmPeerError(f"{who} ended while {what} over shared memory (its process is gone)", dead)
        if waited > self.timeout_s:
            who = ", ".join(f"rank {self.ranks[i]}" for i in waiting)
            raise ShmPeerError(f"{who} did not answer within {self.timeout_s:.0f} s while {what} over shared "
                               "memory", [self.ranks[i] for i in waiting])
