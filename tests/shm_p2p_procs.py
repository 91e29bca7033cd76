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
    time.sleep(0.3)
    expect = messages(peer)
    bufs = [torch.empty_like(t) for _, t in expect]
    recvs = [None] * len(expect)
    for i in sorted(range(len(expect)), key=lambda i: (-expect[i][0], i)):
        recvs[i] = ch.irecv(bufs[i], expect[i][0], what=f"receiving {expect[i][0]}")
    for w in sends + recvs:
        w.wait()
    ok = all(torch.equal(b, t) for b, (_, t) in zip(bufs, expect))
    deadline = time.monotonic() + 10
    while pump.mailbox.segment.linked and time.monotonic() < deadline:  # the pump unlinks it when it can
        time.sleep(0.01)
    out.put((rank, ok, pump.mailbox.segment.linked))
    out.close()
    out.join_thread()


def killed(rank: int, n: int, job: str, out) -> None:
    """One good exchange each way, then rank 1 dies; rank 0 waits for its next message
    and reports what it was told, and how soon."""
    torch.set_num_threads(1)
    peer = 1 - rank
    pump = Pump(job, SECRET, "t", rank, [peer], timeout_s=30, **RING)
    ch = pump.channels[peer]
    x = torch.full((10_000,), float(rank))
    y = torch.empty(10_000)
    s, r = ch.isend(x, 1), ch.irecv(y, 1)
    s.wait()
    r.wait()
    while pump.mailbox.segment.linked:  # both mailboxes mapped by the other: the names are gone
        time.sleep(0.01)
    if rank == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        ch.irecv(y, 2, what="receiving the next partition").wait()
        out.put((rank, "no error", 0.0, []))
    except ShmPeerError as err:
        out.put((rank, str(err), time.monotonic() - t0, err.ranks))
    out.close()
    out.join_thread()
