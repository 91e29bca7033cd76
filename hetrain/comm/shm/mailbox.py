"""A process's shared-memory mailbox: one segment holding a ring of slots per process
that may send to it (comm/shm/channel.py moves messages through them).

Why a ring per ordered pair, and not a segment per message or the arena's one buffer
per member: point-to-point traffic between a worker and its summation server is a
stream of messages (partitions and their sums) of any size, posted long before they are
read (gloo's isend is asynchronous, and the server posts the next step's receives when a
step ends). A ring with one writer and one reader needs no lock: the sender alone moves
`head`, the receiver alone moves `tail`, each on a cache line of its own, and a message
larger than the ring streams through it a slot at a time.

Layout of the data area (after the segment's header, segment.py):

- a directory (`DIRECTORY` bytes): int64 [rings, slots, slot_bytes, sender rank...], so a
  sender finds its ring without knowing how the owner ordered its senders;
- per sender, a ring: a control block (head, tail, the sender's pid, one cache line
  each), then `slots` slots of a 64-byte header (int64 tag, message bytes, offset of
  this chunk in the message, chunk bytes) and `slot_bytes` of data.

The mailbox is created by its owner, which unlinks the name once every sender has
attached (each writes its pid into its ring), like the host group's segments; the
launcher removes what a killed process left (runtime/shmnames.py). Beside it lies its
doorbell (doorbell.py), which a sender rings when it starts a message, so an idle owner
sleeps instead of looking at its rings.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import numpy as np
import torch

from ...errors import UserError
from ...runtime.shmnames import SHM_DIR, segment_name
from .doorbell import Doorbell, bell_path
from .segment import HEADER, MAGIC, Segment

DIRECTORY = 4096
CTL_BYTES = 192
SLOT_HEADER = 64
HEAD, TAIL, PID = 0, 8, 16  # int64 indices in the control block (64 bytes apart)
SLOTS = 8
SLOT_BYTES = 1 << 20  # a chunk stays in the cores' caches between the sender's and the receiver's copy


def memcopy(dst: torch.Tensor, src: torch.Tensor, n: int) -> None:
    """Copy the first `n` bytes of contiguous `src` to `dst`: glibc's memcpy through ctypes,
    which releases the GIL. Why not `dst.copy_(src)`: torch parallelises a copy over its
    intra-op threads, and called from the pump's threads that starts an OpenMP team per
    thread whose spinning workers fight the processes' compute for the host's cores; one
    thread's memcpy is what a ring needs."""
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def ring_bytes(slots: int, slot_bytes: int) -> int:
    return CTL_BYTES + slots * (SLOT_HEADER + slot_bytes)


def mailbox_name(job_id: str, secret: str, key: str, rank: int) -> str:
    """The /dev/shm name of rank `rank`'s mailbox (`key`: the job's round and purpose)."""
    return segment_name(job_id, secret, f"{key}-mbox{rank}")


class Ring:
    """One sender's ring in a mailbox. The sender calls `space`/`put`; the receiver
    `ready`/`peek`/`pop`. Stores are published in program order (x86-64 TSO, as the
    segment's counters are: segment.py `set_counter`), so a reader that sees `head`
    move sees the slot's header and data written before it."""

    def __init__(self, seg: Segment, base: int, slots: int, slot_bytes: int):
        self.slots, self.slot_bytes = slots, slot_bytes
        off = HEADER + base
        self.ctl = np.frombuffer(seg.mm, dtype=np.int64, count=CTL_BYTES // 8, offset=off)
        stride = SLOT_HEADER + slot_bytes
        self.hdr = [np.frombuffer(seg.mm, dtype=np.int64, count=4, offset=off + CTL_BYTES + k * stride)
                    for k in range(slots)]
        lo = base + CTL_BYTES + SLOT_HEADER
        self.data = [seg.data[lo + k * stride: lo + k * stride + slot_bytes] for k in range(slots)]
        self.head = int(self.ctl[HEAD])  # the sender's copy (only the sender moves it)
        self.tail = int(self.ctl[TAIL])  # the receiver's copy (only the receiver moves it)

    # ---- sender ----------------------------------------------------------------------
    def space(self) -> bool:
        return self.head - int(self.ctl[TAIL]) < self.slots

    def put(self, tag: int, total: int, offset: int, chunk: torch.Tensor) -> None:
        """Write one chunk (bytes) of a message into the next slot and publish it."""
        k = self.head % self.slots
        n = chunk.numel()
        if n:
            memcopy(self.data[k], chunk, n)
        h = self.hdr[k]
        h[0], h[1], h[2], h[3] = tag, total, offset, n
        self.head += 1
        self.ctl[HEAD] = self.head

    # ---- receiver --------------------------------------------------------------------
    def ready(self) -> bool:
        return self.tail < int(self.ctl[HEAD])

    def peek(self) -> tuple[int, int, int, torch.Tensor]:
        """The oldest unread chunk: (tag, message bytes, offset, chunk bytes as a view)."""
        k = self.tail % self.slots
        tag, total, offset, n = (int(x) for x in self.hdr[k])
        if not (0 <= n <= self.slot_bytes and 0 <= offset and offset + n <= total):  # never copy past a buffer
            raise RuntimeError(f"corrupt shared-memory ring: chunk of {n} bytes at {offset} of a {total}-byte message")
        return tag, total, offset, self.data[k][:n]

    def pop(self) -> None:
        self.tail += 1
        self.ctl[TAIL] = self.tail

    @property
    def sender_pid(self) -> int:
        return int(self.ctl[PID])


class Mailbox:
    """This process's mailbox: a ring per rank in `senders` and its doorbell (`bell`),
    created here, unlinked once every sender has attached (`tidy`)."""

    def __init__(self, job_id: str, secret: str, key: str, rank: int, senders: Sequence[int],
                 slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        self.senders = sorted(senders)
        self.slot_bytes = slot_bytes
        if 3 + len(self.senders) > DIRECTORY // 8:
            raise UserError(f"a shared-memory mailbox takes at most {DIRECTORY // 8 - 3} senders, "
                            f"got {len(self.senders)}")
        size = ring_bytes(slots, slot_bytes)
        name = mailbox_name(job_id, secret, key, rank)
        self.bell = Doorbell.create(bell_path(SHM_DIR / name))  # first: a complete mailbox has its bell
        try:
            self.segment = Segment.create(name, secret, DIRECTORY + len(self.senders) * size)
        except BaseException:
            self.bell.close()
            raise
        d = np.frombuffer(self.segment.mm, dtype=np.int64, count=3 + len(self.senders), offset=HEADER)
        d[1], d[2] = slots, slot_bytes
        d[3:] = self.senders
        d[0] = len(self.senders)  # last: a directory with its count is complete
        self.rings = {s: Ring(self.segment, DIRECTORY + i * size, slots, slot_bytes)
                      for i, s in enumerate(self.senders)}

    def close(self) -> None:
        """Unmap and unlink (a process that made a mailbox it no longer uses)."""
        self.segment.close()
        self.bell.close()

    def tidy(self) -> bool:
        """Unlink the name once every sender has attached; whether it is gone."""
        if self.segment.linked and all(r.sender_pid for r in self.rings.values()):
            self.segment.unlink()
            self.bell.unlink()
        return not self.segment.linked


def _complete(path) -> bool:
    """Whether the owner has finished making the mailbox at `path`: the segment's magic
    (written last by Segment.create) and the directory's count (written last here)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        head = os.pread(fd, 8, 0)
        count = os.pread(fd, 8, HEADER)
    finally:
        os.close(fd)
    return head == MAGIC and len(count) == 8 and int.from_bytes(count, "little") > 0


def attach(job_id: str, secret: str, key: str, owner: int, sender: int) -> tuple[Segment, Ring, Doorbell] | None:
    """Map rank `owner`'s mailbox and return its ring for `sender` (this process, whose
    pid is written there) and its doorbell; None while the owner has not made it yet. A mailbox without
    this job's token raises SegmentAuthError (segment.py); one without a ring for
    `sender` is a UserError."""
    name = mailbox_name(job_id, secret, key, owner)
    if not _complete(SHM_DIR / name):
        return None
    seg = Segment.attach(name, secret)
    d = np.frombuffer(seg.mm, dtype=np.int64, count=3, offset=HEADER)
    n, slots, slot_bytes = (int(x) for x in d)
    ranks = [int(x) for x in np.frombuffer(seg.mm, dtype=np.int64, count=n, offset=HEADER + 24)]
    if sender not in ranks:
        raise UserError(f"rank {owner}'s shared-memory mailbox has no ring for rank {sender} (it takes messages "
                        f"from {ranks}): the two processes disagree on which peers share their host")
    ring = Ring(seg, DIRECTORY + ranks.index(sender) * ring_bytes(slots, slot_bytes), slots, slot_bytes)
    bell = Doorbell.attach(bell_path(SHM_DIR / name))  # before the pid: the owner unlinks it once all pids are in
    ring.ctl[PID] = os.getpid()
    return seg, ring, bell
