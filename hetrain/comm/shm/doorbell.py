"""A mailbox's doorbell: a named pipe (FIFO) beside the mailbox in /dev/shm that a
sender writes a byte into when it starts a message, so the owner's receiving thread can
sleep in the kernel until something arrives instead of looking at its rings every
fraction of a millisecond.

Why a FIFO. The rings need no lock and no syscall to move data (mailbox.py), but a
reader with nothing to read must either poll or be woken, and waking a thread of
another process takes a kernel object both processes can name. A FIFO is the one such
object that unrelated processes can open by path with nothing passed between them (an
eventfd or a socketpair must be inherited or sent over a socket), that `select` waits
on, and that tmpfs keeps in memory. It carries no data the owner trusts: a byte only
says "look at your rings", so a stray write costs a look and nothing else.

Why a byte per message start and not a flag the reader raises before it sleeps:
"raise the flag, look again, sleep" against "publish, read the flag, ring" needs a
store-load fence on both sides (the stores of one and the loads of the other may pass
each other on x86-64 otherwise), which Python cannot issue. The write and the read are
syscalls, ordered with the ring's stores as program order and the kernel make them. A
chunk that continues a message needs no byte: the reader is in the middle of that
message and naps for at most `channel.NAP_STREAM` between looks.

The owner opens its FIFO for reading and writing (so a sender's non-blocking open for
writing always finds a reader and its own process can ring it as well, for a receive
posted here), makes it before the mailbox's segment (a complete mailbox has its bell),
with mode 0600 under the mailbox's name (which carries the HMAC of the job secret), and
unlinks it with the segment once every sender has attached; the launcher removes one a
killed process left (runtime/shmnames.py: it shares the job's name prefix).
"""
from __future__ import annotations

import errno
import os
import select
import stat
from pathlib import Path

from ...errors import UserError
from .segment import OwnedName

SUFFIX = ".bell"


def bell_path(segment_path: Path) -> Path:
    return segment_path.with_name(segment_path.name + SUFFIX)


class Doorbell(OwnedName):
    """One end of a mailbox's FIFO, with a `threading.Event`'s `set`/`clear`/`wait`, so
    the pump's receiving thread waits on it as its sending thread waits on an event."""

    def __init__(self, path: Path, fd: int, owner: bool):
        self.path, self.fd, self.owner = path, fd, owner
        self.linked = owner

    @classmethod
    def create(cls, path: Path) -> "Doorbell":
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            raise UserError(f"{path} exists already: another process of this job holds it, or a killed run left it "
                            "(the launcher removes a job's shared-memory files when it ends)") from None
        except OSError as err:
            raise UserError(f"cannot make the shared-memory doorbell {path} ({err}): the shared-memory channel needs "
                            "a tmpfs at /dev/shm that takes named pipes; move partitions over gloo with "
                            "`hetrain launch --server-link gloo`") from None
        return cls(path, os.open(path, os.O_RDWR | os.O_NONBLOCK), owner=True)

    @classmethod
    def attach(cls, path: Path) -> "Doorbell":
        """The sender's end: the FIFO the owner made (refusing anything else at the path)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as err:
            if err.errno != errno.ENXIO:
                raise
            raise UserError(f"{path} has no reader: the process that made it is gone") from None
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            raise UserError(f"{path} is not a hetrain doorbell (not a named pipe); refusing to use it")
        return cls(path, fd, owner=False)

    def set(self) -> None:
        """Ring: one byte. A full pipe is a bell already rung; a closed reader (the owner
        gone) is the waiter's to report, as the rings' other failures are."""
        try:
            os.write(self.fd, b"\x01")
        except BlockingIOError:
            pass
        except OSError as err:
            if err.errno not in (errno.EPIPE, errno.EBADF):
                raise

    def clear(self) -> None:
        """Take every ring so far (the owner, before it looks at its rings)."""
        try:
            while len(os.read(self.fd, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout: float | None) -> bool:
        """Sleep until rung or `timeout` seconds (None: until rung); whether it was rung."""
        return bool(select.select([self.fd], [], [], timeout)[0])

    def close(self) -> None:
        self.unlink()
        try:
            os.close(self.fd)
        except OSError:
            pass
