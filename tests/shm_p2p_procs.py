"""Spawned processes for tests/test_shm_p2p.py: two processes of one host that talk
through their shared-memory mailboxes (comm/shm/channel.py), with small rings so that
messages stream through them and many sends are posted before any receive."""
from __future__ import annotations

import os
import signal
import time

import torch

from hetrain.comm.shm.pump import Pump
from hetrain.comm.shm.waits import ShmPeerError

SECRET = "0123456789abcdef0123456789abcdef"
RING = dict(slots=4, slot_bytes=4096)  # 16 KiB a ring: every message below overflows it


def messages(src: int) -> list[tuple[int, torch.Tensor]]:
    """What rank `src` sends: (tag, tensor), odd sizes, fp32 and fp16, an empty one, two
    with one tag (they must arrive in order), one far larger than the ring."""
    g = torch.Generator().manual_seed(100 + src)
    out = []
    for k in range(12):
        dtype = torch.float16 if k % 3 == 2 else torch.float32
        out.append((k, torch.randn(1000 * k + 7, generator=g).to(dtype)))
    out.append((20, torch.empty(0)))
    out.append((21, torch.randn(3, generator=g)))
    out.append((21, torch.randn(3, generator=g)))  # same tag, sent after the one above
    out.append((22, torch.randn(250_001, generator=g)))  # about 1 MB: 61 ring-fulls
    return out


def until(cond, what: str, timeout: float = 10.0) -> None:
    """Wait until `cond()` holds (the channel's state moves on the pump's threads, which
    signal nothing a test could wait on), failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.001)


def exchange(rank: int, n: int, job: str, out) -> None:
    """Both ranks post every send first, then their receives in reverse tag order after
    a pause (the messages wait as orphans or in the ring; two receives of one tag are
    posted in order, and get the messages in the order they were sent), and report
    whether everything arrived intact."""
    torch.set_num_threads(1)
    peer = 1 - rank
    pump = Pump(job, SECRET, "t", rank, [peer], timeout_s=30, **RING)
    ch = pump.channels[peer]
    sent = messages(rank)
    sends = [ch.isend(t, tag, what=f"sending {tag}") for tag, t in sent]
    until(ch.inbox.ready, "the peer's first message in this ring before any receive is posted")
    expect = messages(peer)
    bufs = [torch.empty_like(t) for _, t in expect]
    recvs = [None] * len(expect)
    for i in sorted(range(len(expect)), key=lambda i: (-expect[i][0], i)):
        recvs[i] = ch.irecv(bufs[i], expect[i][0], what=f"receiving {expect[i][0]}")
    for w in sends + recvs:
        w.wait()
    ok = all(torch.equal(b, t) for b, (_, t) in zip(bufs, expect))
    try:  # the pump unlinks the name once every sender has attached
        until(lambda: not pump.mailbox.segment.linked, "the mailbox's name unlinked")
    except TimeoutError:
        pass  # reported: the test fails on it
    out.put((rank, ok, pump.mailbox.segment.linked))
    out.close()
    out.join_thread()


def killed(rank: int, n: int, job: str, out) -> None:
    """One good exchange each way, then rank 1 dies as rank 0 starts waiting for its next
    message; rank 0 reports what it was told, and how soon."""
    torch.set_num_threads(1)
    peer = 1 - rank
    pump = Pump(job, SECRET, "t", rank, [peer], timeout_s=30, **RING)
    ch = pump.channels[peer]
    x = torch.full((10_000,), float(rank))
    y = torch.empty(10_000)
    s, r = ch.isend(x, 1), ch.irecv(y, 1)
    s.wait()
    r.wait()
    # both mailboxes mapped by the other: the names are gone
    until(lambda: not pump.mailbox.segment.linked, "the mailbox's name unlinked")
    if rank == 1:  # dies once rank 0 says it is about to wait for its next message
        ch.irecv(torch.empty(1), 3).wait()
        os.kill(os.getpid(), signal.SIGKILL)
    ch.isend(torch.zeros(1), 3).wait()
    t0 = time.monotonic()
    try:
        ch.irecv(y, 2, what="receiving the next partition").wait()
        out.put((rank, "no error", 0.0, []))
    except ShmPeerError as err:
        out.put((rank, str(err), time.monotonic() - t0, err.ranks))
    out.close()
    out.join_thread()
