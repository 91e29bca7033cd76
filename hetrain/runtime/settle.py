"""Let a process's native threads settle before the interpreter finalises.

Why: torch.distributed's gloo backend runs each collective on a worker thread of its
own, and a collective started inside backward (DDP's buckets, hetrain's overlapped
gradients) captures the thread-local state of the autograd call, which holds a Python
object (the `contextvars` context torch stashes for the backward pass). The worker
thread drops its reference to the finished collective just after marking it complete.
When the main thread has already reached interpreter finalisation by then (a short
script end, a loaded host that leaves the worker thread waiting for a core), that last
reference takes the GIL inside a C++ destructor, CPython ends the thread with a forced
unwind, and the unwind through the destructor aborts the process: "terminate called
without an active exception", SIGABRT, a finished rank reported as failed. Plain
torchrun runs show it too (2 of 6 runs of a DDP script on a loaded 2-core host).

`settle_native_threads` runs at exit while the interpreter is still whole (an `atexit`
handler registered before any other, so it runs last): it sleeps in short polls,
releasing the GIL, until no other thread of the process is runnable for a few polls in
a row (Linux: the thread states in /proc/self/task), so a worker thread still finishing
a collective completes its release while that is safe. A thread that keeps running (a
spinning OpenMP pool) only costs the bounded wait.
"""
from __future__ import annotations

import atexit
import os
import threading
import time

from .heartbeat import proc_state

_REGISTERED = False


def _runnable_threads(me: int) -> list[int]:
    """Other threads of this process that are running or waiting for a core (state R)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
    # /proc/<tid> reads a thread as /proc/<pid> reads a process
    return [tid for tid in tids if tid != me and proc_state(tid) == "R"]


def settle_native_threads(max_wait_s: float = 1.0, poll_s: float = 0.002, quiet_polls: int = 3) -> bool:
    """Wait, GIL released, until no other thread is runnable in `quiet_polls` polls in a
    row, or `max_wait_s` passed. True when they settled; False on timeout or where the
    thread states cannot be read (not Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return False
    me = threading.get_native_id()
    deadline = time.monotonic() + max_wait_s
    quiet = 0
    while True:
        quiet = 0 if _runnable_threads(me) else quiet + 1
        if quiet >= quiet_polls:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def settle_at_exit() -> None:
    """Register `settle_native_threads` to run at interpreter exit, after every `atexit`
    handler registered later (once per process)."""
    global _REGISTERED
    if not _REGISTERED:
        _REGISTERED = True
        atexit.register(settle_native_threads)
