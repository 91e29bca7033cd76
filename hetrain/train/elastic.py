"""Elastic stop requests: SIGUSR1 means "finish this step, checkpoint, exit with
EXIT_STOPPED" (the scheduler resizes a job this way).

The launcher starts processes with SIGUSR1 blocked, so a request that arrives before
a script is ready stays pending instead of killing it; `on_stop_request` installs the
handler and only then unblocks, delivering any pending request at once.
"""
from __future__ import annotations

import signal
import threading

from ..runtime.launcher import EXIT_STOPPED

__all__ = ["EXIT_STOPPED", "on_stop_request"]


def on_stop_request(*, include_sigterm: bool = True) -> threading.Event:
    """Return an Event that is set when this process is asked to stop."""
    event = threading.Event()

    def _handler(signum, frame) -> None:
        event.set()

    signal.signal(signal.SIGUSR1, _handler)
    if include_sigterm:
        signal.signal(signal.SIGTERM, _handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    return event
