"""Point-to-point messages between two processes of one host through shared memory,
with gloo's semantics: `isend`/`irecv` return at once, a receive matches the sender's
message by (source, tag), messages with one tag arrive in the order they were sent, a
message nobody has asked for yet is kept until someone does, and posting sends never
blocks however many are posted before any receive.

Why this shape. The worker <-> summation-server protocol (comm/transports/base.py
`ServerLeg`, comm/server.py) posts every partition's send and receive at once and waits
later; the server posts the next step's receives long before the workers send. A
channel therefore needs to move bytes while neither side waits on it, as gloo's I/O
thread does. Here two background threads per process (comm/shm/pump.py) do the copies: one writes
pending sends into the receivers' mailbox rings a slot at a time (comm/shm/mailbox.py),
the other reads this process's rings into the posted receive buffers, so a message is copied twice
(sender's buffer -> slot -> receiver's buffer) at memcpy speed, with no socket and no
kernel crossing. Copies release the GIL (glibc's memcpy through ctypes: mailbox.py
`memcopy`), so they overlap the caller's compute. A message that arrives before its receive is posted goes to a buffer of its
own (kept while the ring behind it drains) and is copied over when the receive comes.
A sender rings the receiver's doorbell (doorbell.py) when a message starts, so a process
whose receives wait for a message that is slow to come (a server between steps) sleeps
in the kernel rather than looking at its rings.

Why not a server-leg special (workers writing partitions into slots the server sums
from): the server sums a machine's pushes with a weighted matmul over one buffer of
rows, and its speculation, layout switches and codecs already run on posted receives;
a channel behind p2p's isend/irecv keeps all of that as it is, and a pair that does not
share a host keeps gloo behind the same interface (`p2p.GlooChannel`).

Failure semantics as the host group's (waits.py): a wait checks every `CHECK_S` whether
the peer's process is gone (its pid is in its mailbox header or its ring) or the
launcher lost it (`lost`), and raises `ShmPeerError` naming it; a peer that never
answers fails the wait after `timeout_s`. Nothing read from shared memory is unpickled:
headers are int64 fields, payloads raw bytes copied into the caller's tensor.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from datetime import timedelta

import torch

from ..p2p import host_only
from .mailbox import Ring, attach, memcopy
from .waits import CHECK_S, ShmPeerError, gone

# the longest nap while a message streams through a ring: the peer frees or fills a slot
# in the time of one chunk's copy and rings no bell for it, so a longer nap would leave
# the ring idle. A message's start rings the receiver's doorbell (doorbell.py), so
# nothing naps while it waits for one: the receiving thread and waiters sleep until woken.
NAP_STREAM = 5e-5
# a waiter first polls, yielding the core between looks, for this long: a sleep of any
# length lasts 50 us or more (the kernel's timer slack), a round trip of a small message
# much less
YIELD_S = 2e-4
ATTACH_EVERY = 5e-3  # how often the pump looks for a receiver's mailbox not made yet


def _bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    host_only(t, what)  # the same guard as gloo's sends: CUDA tensors go through the staging
    if not t.is_contiguous():
        raise ValueError(f"{what}: shared-memory messages take contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


class ShmWork:
    """A send or receive in flight: `wait()` and `is_completed()` as a torch.distributed
    work object has them. `got` counts the bytes moved so far."""

    __slots__ = ("chan", "view", "tag", "sending", "what", "got", "error", "done", "started")

    def __init__(self, chan: "ShmChannel | None", view: torch.Tensor, tag: int, sending: bool, what: str):
        self.chan, self.view, self.tag, self.sending, self.what = chan, view, tag, sending, what
        self.got = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.started = time.monotonic()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done, moving this channel's messages in the waiting thread too
        where its pump thread is not at it (no hand-over to wait for) while they stream;
        a message that has not started is the pump's to move when the doorbell rings, so
        the waiter sleeps until the work is done. A lost peer raises ShmPeerError naming
        it (within CHECK_S)."""
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        start = time.monotonic()
        check_at, nap = start + CHECK_S, 0.0
        while not self.done.is_set():
            if self.chan.help(self.sending):
                nap = 0.0
                continue
            if time.monotonic() - start < YIELD_S:  # a peer on another core is usually there already
                time.sleep(0)
                continue
            streaming = self.chan.streaming(self.sending)
            nap = min(NAP_STREAM, max(1e-5, nap * 2)) if streaming else CHECK_S
            if self.done.wait(nap):
                break
            if time.monotonic() >= check_at:
                self.chan.check(self, limit)
                check_at = time.monotonic() + CHECK_S
        if self.error is not None:
            raise self.error
        return True


class ShmChannel:
    """Messages to and from one peer on this host (see the module docstring). The
    `group` argument of isend/irecv (a gloo lane) does not matter here: a tag names a
    message between the pair on every lane."""

    def __init__(self, pump, peer: int):
        self.pump, self.peer = pump, peer
        self.inbox: Ring = pump.mailbox.rings[peer]
        self.out: Ring | None = None  # the peer's ring for us, once its mailbox exists
        self.out_bell = None  # ... and its doorbell
        self.out_pid = 0
        self.next_attach = 0.0
        self.sends: deque[ShmWork] = deque()
        self.posted: dict[int, deque[ShmWork]] = {}
        self.orphans: dict[int, deque[ShmWork]] = {}  # arrived before their receive was posted
        self.current: ShmWork | None = None  # the message the inbox is in the middle of
        self.n_posted = 0  # receives in `posted`
        # the sending half (sends, the peer's ring) and the receiving half (posted,
        # orphans, current, the inbox) each move under a lock of its own, by the pump's
        # thread for that half or by a caller (posting, or waiting: `help`)
        self.locks = (threading.Lock(), threading.Lock())  # [receiving, sending]

    def isend(self, t: torch.Tensor, tag: int, group=None, what: str = "send") -> ShmWork:
        """Post a send. A message of one slot or less, with nothing queued before it and
        room in the ring, is written at once (no hand-over to the pump's thread); a
        larger one is left to the thread, so posting never waits for a long copy."""
        work = ShmWork(self, _bytes(t, what), tag, True, what)
        with self.locks[True]:
            self.sends.append(work)
            if work.view.numel() <= self.pump.slot_bytes and len(self.sends) == 1:
                self.pump_out()
        if not work.done.is_set():
            self.pump.wake(True)
        return work

    def irecv(self, t: torch.Tensor, tag: int, group=None, what: str = "receive") -> ShmWork:
        """Post a receive (matched at once by a message already kept for its tag)."""
        work = ShmWork(self, _bytes(t, what), tag, False, what)
        with self.locks[False]:
            self.take(work)
        if not work.done.is_set():
            self.pump.wake(False)
        return work

    def help(self, sending: bool) -> bool:
        """Move this channel's messages of one direction from a waiting caller, unless the
        pump's thread is at them; whether anything moved."""
        lock = self.locks[sending]
        if not lock.acquire(blocking=False):
            return False
        try:
            return self.pump_out() if sending else self.pump_in()
        except Exception as err:  # handed to whoever waits on the channel's works
            self.fail(err, sending)
            return True
        finally:
            lock.release()

    # ---- the waiter's checks (caller's thread) ----------------------------------------
    def check(self, work: ShmWork, limit: float | None) -> None:
        """Raise ShmPeerError when the peer is gone or silent past the timeout."""
        pid = self.out_pid if work.sending else self.inbox.sender_pid
        waited = time.monotonic() - work.started
        if (pid and gone(pid)) or self.peer in self.pump.lost_ranks():
            raise ShmPeerError(f"rank {self.peer} ended while {work.what} over shared memory (its process is gone)",
                               [self.peer])
        if waited > (self.pump.timeout_s if limit is None else limit):
            raise ShmPeerError(f"rank {self.peer} did not answer within {waited:.0f} s while {work.what} over "
                               "shared memory", [self.peer])

    # ---- moving messages (under the direction's lock) ----------------------------------
    def take(self, work: ShmWork) -> None:
        """A posted receive enters the channel's queues."""
        waiting = self.orphans.get(work.tag)
        if not waiting:
            self.posted.setdefault(work.tag, deque()).append(work)
            self.n_posted += 1
            return
        orphan = waiting.popleft()
        if orphan.view.numel() != work.view.numel():
            work.finish(self._mismatch(orphan.view.numel(), work))
            return
        memcopy(work.view, orphan.view, orphan.got)
        work.got = orphan.got
        if orphan.done.is_set():
            work.finish()
        else:  # still arriving: the rest goes straight into the receiver's buffer
            self.current = work

    def streaming(self, sending: bool) -> bool:
        """A message is part-way through: sends wait for room in an attached ring, or the
        inbox is in the middle of one."""
        if sending:
            return bool(self.sends) and self.out is not None
        return self.current is not None

    def outstanding(self, sending: bool) -> bool:
        if sending:
            return bool(self.sends)
        return self.current is not None or self.n_posted > 0

    def pump_out(self) -> bool:
        """Write pending sends into the peer's ring while it has room, ringing its doorbell
        once a message has started (after the chunk: a woken reader finds it); whether any
        moved."""
        if not self.sends or not self._attached():
            return False
        ring, moved, started = self.out, False, False
        while self.sends and ring.space():
            w = self.sends[0]
            n = min(ring.slot_bytes, w.view.numel() - w.got)
            started |= w.got == 0
            ring.put(w.tag, w.view.numel(), w.got, w.view[w.got:w.got + n])
            w.got += n
            moved = True
            if w.got >= w.view.numel():
                self.sends.popleft()
                w.finish()
        if started:
            self.out_bell.set()
        return moved

    def pump_in(self) -> bool:
        """Read this peer's ring into posted receives (or orphans) while anything is
        expected; whether any chunk moved."""
        moved = False
        while (self.current is not None or self.n_posted) and self.inbox.ready():
            tag, total, offset, chunk = self.inbox.peek()
            if offset == 0:
                self.current = self._destination(tag, total)
            w = self.current
            n = chunk.numel()
            if n:
                memcopy(w.view[offset:], chunk, n)
            w.got = offset + n
            self.inbox.pop()
            moved = True
            if w.got >= total:
                self.current = None
                if not w.done.is_set():
                    w.finish()
        return moved

    def _destination(self, tag: int, total: int) -> ShmWork:
        """Where a new message goes: the oldest receive posted for its tag, else a buffer
        of its own kept for the receive to come. A receive of another size fails (as
        gloo's does) and the message is read into a scratch buffer and dropped."""
        waiting = self.posted.get(tag)
        if waiting:
            w = waiting.popleft()
            self.n_posted -= 1
            if w.view.numel() == total:
                return w
            w.finish(self._mismatch(total, w))
            return ShmWork(None, torch.empty(total, dtype=torch.uint8), tag, False, "dropped")
        orphan = ShmWork(None, torch.empty(total, dtype=torch.uint8), tag, False, "unmatched")
        self.orphans.setdefault(tag, deque()).append(orphan)
        return orphan

    def fail(self, err: BaseException, sending: bool) -> None:
        """Every work of one direction fails with `err` (its pump hit an error on it)."""
        if sending:
            works = list(self.sends)
            self.sends.clear()
        else:
            works = [w for q in self.posted.values() for w in q]
            works += [self.current] if self.current is not None else []
            self.posted.clear()
            self.n_posted, self.current = 0, None
        for w in works:
            if not w.done.is_set():
                w.finish(err)

    def _mismatch(self, total: int, w: ShmWork) -> RuntimeError:
        return RuntimeError(f"{w.what}: rank {self.peer} sent a message of {total} bytes with tag {w.tag} "
                            f"to a receive buffer of {w.view.numel()} bytes")

    def _attached(self) -> bool:
        if self.out is not None:
            return True
        now = time.monotonic()
        if now < self.next_attach:
            return False
        self.next_attach = now + ATTACH_EVERY
        p = self.pump
        try:
            found = attach(p.job_id, p.secret, p.key, self.peer, p.rank)
        except BaseException as err:  # another job's segment, or disagreeing peers: every send fails
            for w in self.sends:
                w.finish(err)
            self.sends.clear()
            return False
        if found is None:
            return False
        seg, self.out, self.out_bell = found
        self.out_pid = seg.pid
        p.keep.append(seg)
        return True
