"""Launching, rendezvous and the per-process job context."""
from __future__ import annotations

import signal
import threading

# SIGUSR1 = "checkpoint and stop" (elastic resizing). Caught from the CLI's first line on,
# so a request that arrives while the launcher is still starting is not lost.
STOP_REQUESTED = threading.Event()


def catch_stop_requests() -> None:
    """Record SIGUSR1 from now on; a request that arrived while Python started (a caller may
    start hetrain with SIGUSR1 blocked, as the scheduler's executor does) is taken now."""
    signal.signal(signal.SIGUSR1, lambda signum, frame: STOP_REQUESTED.set())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
