"""The credit window: how many partitions a worker keeps in flight to the servers.

Default: a window per server (at most `per_server` partitions in flight to each). A byte
budget over all servers (`--credit-bytes`) lets a worker whose flows happen to run fast
put several partitions ahead at one server while another worker's first one is still on
its way; that server can sum nothing until the slowest worker's partition arrives whole,
so its uplink idles. A per-server window keeps every worker within a few partitions of
the others at each server.

Overlapped steps (and every step under --overlap without --credit-bytes) are unlimited:
each partition is posted as soon as it is ready. Holding one back would idle the link
until the next gradient hook fires, and waiting for an early-posted (late-layer) sum
while an earlier partition is held back could deadlock against a server that sums in
partition order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

WINDOW_BYTES = 256 * 1024


def window_partitions(partition_bytes: int) -> int:
    """Partitions in flight per server by default: at least 2 (one summing, one
    arriving) and about 256 KiB, chosen by sweeping 128 KiB-1 MiB over bench/comm.py's
    8 MB cases (exploratory runs, not recorded; the chosen value's results are in
    bench/results/comm-*.txt). Less was unstable; more lets the workers' flows into one
    server drift apart, and a server can sum a partition only when the slowest worker's
    copy is in."""
    return max(2, -(-WINDOW_BYTES // max(1, partition_bytes)))


@dataclass
class CreditWindow:
    """Accounting only: the transport asks `admits` before posting and reports `sent` and
    `done`; `victim` says whose oldest partition to wait for when the window is full."""

    per_server: int  # partitions in flight per server; 0: use the byte budget instead
    budget: int  # bytes in flight over all servers (when per_server is 0)
    unlimited: bool = False
    inflight: dict[int, int] = field(default_factory=dict)  # server -> partitions in flight
    used: int = 0  # bytes in flight

    @classmethod
    def for_job(cls, partition_bytes: int, credit_bytes: int, unlimited: bool) -> "CreditWindow":
        return cls(0 if credit_bytes else window_partitions(partition_bytes), max(1, credit_bytes), unlimited)

    def admits(self, server: int, nbytes: int) -> bool:
        if self.unlimited:
            return True
        if self.per_server:
            return self.inflight.get(server, 0) < self.per_server
        return self.used == 0 or self.used + nbytes <= self.budget

    def victim(self, server: int) -> int | None:
        """The server whose oldest partition must finish before `server` may send again:
        itself under a per-server window, None (the oldest overall) under a byte budget."""
        return server if self.per_server else None

    def sent(self, server: int, nbytes: int) -> None:
        self.inflight[server] = self.inflight.get(server, 0) + 1
        self.used += nbytes

    def done(self, server: int, nbytes: int) -> None:
        self.inflight[server] -= 1
        self.used -= nbytes
