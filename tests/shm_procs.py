"""Spawned processes for the shared-memory tests (tests/test_shm_group.py,
tests/test_shm_arena.py): a gloo group of n members, started with `spawn`, and the
member that all-reduces once, then loses its last member to SIGKILL mid-exchange."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import torch
import torch.distributed as dist

from hetrain.comm.shm.waits import ShmPeerError

SECRET = "0123456789abcdef0123456789abcdef"


def init(rank: int, n: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)


def spawn(target, n: int, *args) -> list:
    """Start `target(rank, n, *args)` in n spawned processes; returns them."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, n, *args)) for r in range(n)]
    for p in procs:
        p.start()
    return procs


def killed_member(rank: int, n: int, path: str, job: str, kind: str, out) -> None:
    """One good all-reduce over a group of `kind` ("rounds": a HostGroup on a tensor of its
    own; "arena": an ArenaGroup on a bucket in its segment), then the last member dies
    before the next round and the others report what they were told, and how soon."""
    from hetrain.comm.shm.arena import ArenaGroup, arena_bytes
    from hetrain.comm.shm.group import HostGroup

    init(rank, n, path)
    kw = dict(job_id=job, secret=SECRET, key="g", ranks=list(range(n)), rank=rank, barrier=dist.barrier,
              timeout_s=30)
    if kind == "arena":
        g = ArenaGroup(capacity=arena_bytes([100_000]), **kw)
        x = g.alloc(100_000)
        x.fill_(1.0)
    else:
        g = HostGroup(capacity=1 << 20, **kw)
        x = torch.ones(100_000)
    g.all_reduce(x)  # one good round: every member is in
    if rank == n - 1:  # dies before the next round: the others wait in it for a member that never comes
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        g.start(x).wait()
        out.put((rank, "no error", 0.0, []))
    except ShmPeerError as err:
        out.put((rank, str(err), time.monotonic() - t0, err.ranks))
    out.close()
    out.join_thread()  # flushed before the hard exit
    os._exit(0)  # the gloo group has a dead member: leave without its teardown


def run_all(target, n: int, path: str, job: str, timeout_s: float = 240) -> list[int]:
    """`target(rank, n, path, job)` in n spawned processes, to their end; their exit codes."""
    procs = spawn(target, n, path, job)
    for p in procs:
        p.join(timeout_s)
    return [p.exitcode for p in procs]
