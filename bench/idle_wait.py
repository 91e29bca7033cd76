"""What a process costs while it waits for a message that is slow to come: a summation
server between steps, or a worker sitting out, has a receive posted and nothing to do.
The shared-memory channel (comm/shm/channel.py, its pump's threads and a waiter) beside
gloo over TCP loopback, in the same run.

Two spawned processes per link. Rank 0 posts one receive of 4 KB and waits on it; rank
1 sends it after `--idle` seconds. The table gives rank 0's CPU seconds (its process
time: every thread, the pump's and gloo's included) over the wait, as a share of one
core; the physical bound is 0 (a waiter the kernel wakes costs nothing while it
sleeps). Also the delay from rank 1's send to rank 0's wait returning (both on one host
clock), the median over the repeats.

    python bench/idle_wait.py [--quick] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECRET = "0123456789abcdef0123456789abcdef"
LINKS = ("shm", "gloo")


def _channel(link: str, rank: int, job: str, port: int):
    """(send, recv) for the pair: the shared-memory channel, or gloo's isend/irecv."""
    if link == "shm":
        from hetrain.comm.shm.pump import Pump

        ch = Pump(job, SECRET, "idle", rank, [1 - rank], timeout_s=60).channels[1 - rank]
        return (lambda t, tag: ch.isend(t, tag)), (lambda t, tag: ch.irecv(t, tag))
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    return (lambda t, tag: dist.isend(t, 1 - rank, tag=tag)), (lambda t, tag: dist.irecv(t, 1 - rank, tag=tag))


def _pair(rank: int, link: str, job: str, port: int, idle: float, repeats: int, out) -> None:
    import torch

    torch.set_num_threads(1)
    send, recv = _channel(link, rank, job, port)
    x = torch.zeros(512, dtype=torch.float64)  # float64: the send's time stamp travels in x[0]
    for tag in (1, 2):  # both ends attached and warm
        (send if rank == tag - 1 else recv)(x, tag).wait()
    rows = []
    for k in range(repeats):
        tag = 10 + k
        if rank == 0:
            w = recv(x, tag)
            c0, t0 = time.process_time(), time.monotonic()
            w.wait()
            t1, c1 = time.monotonic(), time.process_time()
            rows.append({"wait_s": t1 - t0, "cpu_s": c1 - c0, "delay_s": t1 - float(x[0])})
        else:
            time.sleep(idle)
            x[0] = time.monotonic()  # CLOCK_MONOTONIC is one clock for the host's processes
            send(x, tag).wait()
    if rank == 0:
        out.put(rows)
    else:
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(link: str, idle: float, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    job, port = f"idle-{uuid.uuid4().hex[:8]}", _free_port()
    ps = [ctx.Process(target=_pair, args=(r, link, job, port, idle, repeats, out)) for r in range(2)]
    for p in ps:
        p.start()
    rows = out.get(timeout=60 + 2 * idle * repeats)
    for p in ps:
        p.join(30)
    cpu, wait = sum(r["cpu_s"] for r in rows), sum(r["wait_s"] for r in rows)
    return {"link": link, "idle_s": idle, "repeats": repeats, "wait_s": wait, "cpu_s": cpu,
            "core_share": cpu / wait, "delay_ms": 1e3 * statistics.median(r["delay_s"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 s waits, 3 repeats")
    ap.add_argument("--idle", type=float, help="seconds each wait lasts (default 2)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    idle, repeats = a.idle or (1.0 if a.quick else 2.0), 3 if a.quick else 5
    cases = [measure(link, idle, repeats) for link in LINKS]
    print(f"\na receive posted {idle:.1f} s before its message, {repeats} times; rank 0's CPU while it waits "
          f"(bound: 0), on {len(os.sched_getaffinity(0))} cores")
    print(f"{'link':>6}{'waited s':>10}{'CPU s':>9}{'of a core':>11}{'delay ms':>10}")
    for c in cases:
        print(f"{c['link']:>6}{c['wait_s']:>10.2f}{c['cpu_s']:>9.3f}{c['core_share']:>10.1%}{c['delay_ms']:>10.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"idle_wait": cases}, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
