"""One shared-memory segment: a file in /dev/shm, mapped into every process of a host group.

Why files in /dev/shm opened by hand and mapped with `mmap`, not
`multiprocessing.shared_memory`: Python 3.11's `SharedMemory` registers every segment
it opens, created or attached, with the resource tracker, which unlinks (and warns
about) segments of other processes when an attaching process exits, and it cannot
create with O_EXCL under a name of ours and mode 0600 *and* verify a header before the
first use. Here the creator opens with O_CREAT|O_EXCL and mode 0600, writes the header
(magic, admission token, its pid), and unlinks the name as soon as every member has
mapped it (`unlink`): from then on the memory lives exactly as long as the mappings, so
a SIGKILLed process leaves nothing in /dev/shm (the launcher removes what a process
killed during set-up left, runtime/shmnames.py).

Layout: a 4 KiB header (magic, token, pid, and the control counters, each on a cache
line of its own), then the data area.
"""
from __future__ import annotations

import hmac
import mmap
import os
from pathlib import Path

import numpy as np
import torch

from ...errors import UserError
from ...runtime.shmnames import SHM_DIR, TOKEN_BYTES, token

MAGIC = b"HTSHM001"
HEADER = 4096
_PID = 48  # int64
# control counters: int64 each, 64 bytes apart (one cache line each, no false sharing)
WRITTEN, REDUCED, DONE = 0, 1, 2
_COUNTERS = 128
_STRIDE = 8  # in int64 units


class SegmentAuthError(UserError):
    """A segment that does not carry this job's token (another job's, or a forgery)."""


class OwnedName:
    """A name in /dev/shm that its creator (`owner`) unlinks once, when every process that
    needs it has opened it (a segment, a mailbox's doorbell); `path` and `linked` set by
    the subclass."""

    path: Path
    owner: bool
    linked: bool

    def unlink(self) -> None:
        """Remove the name (the creator, once every member has opened it); what it names
        stays until the last mapping or descriptor goes."""
        if self.owner and self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class Segment(OwnedName):
    """A mapped segment. `data` is the data area as bytes (a uint8 tensor); `counter(i)`
    and `set_counter(i, v)` read and publish control counters."""

    def __init__(self, name: str, mm: mmap.mmap, capacity: int, owner: bool):
        self.name = name
        self.path = SHM_DIR / name
        self.mm = mm
        self.capacity = capacity
        self.owner = owner
        self._ctl = np.frombuffer(mm, dtype=np.int64, count=(HEADER - _COUNTERS) // 8, offset=_COUNTERS)
        self.data = torch.frombuffer(mm, dtype=torch.uint8, count=capacity, offset=HEADER)
        self.linked = owner

    # ---- creation and attachment -----------------------------------------------------
    @classmethod
    def create(cls, name: str, secret: str, capacity: int) -> "Segment":
        """Create the segment (refusing one that exists: a stale or foreign file)."""
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise UserError(f"shared-memory segment {path} exists already: another process of this job holds it, "
                            "or a killed run left it (the launcher removes a job's segments when it ends)") from None
        try:
            os.ftruncate(fd, HEADER + capacity)
            mm = mmap.mmap(fd, HEADER + capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as err:
            os.close(fd)
            os.unlink(path)
            raise UserError(f"cannot make a {capacity >> 20} MiB shared-memory segment in {SHM_DIR} ({err}); "
                            "free space there or give the container more (docker --shm-size)") from None
        os.close(fd)
        mm[_PID:_PID + 8] = np.int64(os.getpid()).tobytes()
        mm[8:8 + TOKEN_BYTES] = token(secret, name)
        mm[0:8] = MAGIC  # last: a header with the magic is complete
        return cls(name, mm, capacity, owner=True)

    @classmethod
    def attach(cls, name: str, secret: str) -> "Segment":
        """Map a peer's segment after checking that its header holds this job's token
        (HMAC of the secret over the name): without the secret, nothing is attached."""
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise UserError(f"shared-memory segment {path} does not exist: its owner has not made it, or has left") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER:
                raise SegmentAuthError(f"{path} is no hetrain segment (only {size} bytes)")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if mm[0:8] != MAGIC or not hmac.compare_digest(mm[8:8 + TOKEN_BYTES], token(secret, name)):
            mm.close()
            raise SegmentAuthError(f"shared-memory segment {path} does not carry this job's token: it belongs to "
                                   "another job, or this process does not have the job secret; refusing to use it")
        return cls(name, mm, size - HEADER, owner=False)

    # ---- header ----------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return int(np.frombuffer(self.mm, dtype=np.int64, count=1, offset=_PID)[0])

    def counter(self, which: int) -> int:
        return int(self._ctl[which * _STRIDE])

    def set_counter(self, which: int, value: int) -> None:
        """Publish a counter. The data written before it is visible to a reader that
        sees the new value: x86-64 and the kernel's shared mapping keep stores in order
        (TSO), and torch's kernels have joined their threads before this store."""
        self._ctl[which * _STRIDE] = value

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.data[:numel * dtype.itemsize].view(dtype)

    # ---- end -------------------------------------------------------------------------
    def close(self) -> None:
        self.unlink()
        self.data = None
        self._ctl = None
        try:
            self.mm.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last view
            pass
