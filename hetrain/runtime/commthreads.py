"""gloo's socket thread yields its core to the compute it shares it with.

Each gloo process group runs one event-loop thread (`gloo_tcp_loop`) that reads the
sockets; the collective itself runs on another thread (`pt_gloo_runloop`), which holds a
connection's lock while it posts a send or a receive. When data arrives, the loop thread
wakes and, finding that lock held, skips the connection and polls again at once: epoll is
level-triggered, so it spins (gloo's own tracker calls this out: "Don't busy-spin in tcp
transport's event loop", pytorch/gloo#246). Where the two threads share a core, the woken
loop thread preempts the lock holder and spins for a whole scheduler slice, about 3 ms,
before the holder runs again, once or more per collective. `bench/gloo_thread.py` (2
workers, a core each, torch 2.13): a 2.2 MB all-reduce after 15 ms of compute took 4.2
ms, a 4 KB one 2.6 ms, against 1.4 ms and 0.5 ms with the loop thread in the SCHED_IDLE
class, which runs it only on time no other thread of the core wants: the spin can no
longer delay the thread it is waiting for, and an idle core still serves the socket at once.

The cost: while every thread of the core computes, the loop thread does not read, so a
collective issued during backward makes progress only when compute pauses (the kernel
still receives into the socket buffer). Where compute fills the cores that progress was
never free: it took its time from backward. Where other processes share the cores (a
summation server, data-loading workers, several workers on one host), their threads
would starve it too, and an exchange would wait on work that is not its own. And where
summation servers send while the worker computes (modes byteps, ps, colocated), reading
their partitions during backward is the overlap itself. Policy
(`CommConfig.gloo_thread`): `auto` lowers the threads of a worker of an all-reduce job
(`--mode allreduce`: every exchange a collective among workers that all compute) that
computes on the host, on cores of its own (the launcher pins a machine with `threads: N`
to N cores no other process gets, runtime/cores.py) that its torch threads fill; `idle`
lowers them everywhere; `normal` never.

So the wait for a collective is no idle time either: the thread waiting on its result is
what lets the socket thread run. Work meant for that wait (`PushPull.while_waiting`) runs
elsewhere while the loop threads yield (`yielding()`).

Lowering a thread's own scheduling class needs no privilege (sched(7)); where the call
fails or the platform lacks it, the job runs with the thread as it was.
"""
from __future__ import annotations

import os
from pathlib import Path

from .env import GlooThread

LOOP_THREAD = "gloo_tcp_loop"  # the name gloo gives its tcp transport's event loop
_active = False  # this process's policy lowers its loop threads (set by `configure`)
_lowered: set[int] = set()  # loop threads this process lowered


def loop_threads(name: str = LOOP_THREAD) -> list[int]:
    """Thread ids of this process whose name is `name` (Linux /proc; none elsewhere)."""
    tids = []
    try:
        entries = list(Path("/proc/self/task").iterdir())
    except OSError:
        return tids
    for task in entries:
        try:
            if (task / "comm").read_text().strip() == name:
                tids.append(int(task.name))
        except (OSError, ValueError):  # a thread that ended while we looked
            continue
    return tids


def compute_fills_cores() -> bool:
    """Whether this process's torch threads occupy every core it may run on."""
    if not hasattr(os, "sched_getaffinity"):
        return False
    import torch

    return torch.get_num_threads() >= len(os.sched_getaffinity(0))


def lowers(policy: GlooThread, on_host: bool, own_cores: bool, all_reduce: bool = True) -> bool:
    """Whether `policy` lowers this process's loop threads (see the module docstring)."""
    if policy == "auto":
        return all_reduce and on_host and own_cores and compute_fills_cores()
    return policy == "idle"


def configure(policy: GlooThread, on_host: bool, own_cores: bool, all_reduce: bool = True) -> int:
    """Decide once for this process (after `init()` made its groups) and lower the loop
    threads that exist now. Returns how many were lowered."""
    global _active
    _active = lowers(policy, on_host, own_cores, all_reduce)
    return yield_loop_threads()


def yielding() -> bool:
    """Whether this process's gloo loop threads run only on time compute leaves."""
    return _active and bool(_lowered)


def yield_loop_threads() -> int:
    """Lower every gloo loop thread that exists now and was not lowered before, if this
    process's policy says so (`configure`). A thread names itself once it runs, so one
    just started can be missed: groups made later (comm/group.py) and the first exchange
    (comm/engine.py) call this again. Returns how many were lowered now."""
    if not _active or not hasattr(os, "SCHED_IDLE"):
        return 0
    lowered = 0
    for tid in loop_threads():
        if tid in _lowered:
            continue
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # not permitted here (a sandbox's seccomp policy): keep it as it was
            continue
        _lowered.add(tid)
        lowered += 1
    return lowered
