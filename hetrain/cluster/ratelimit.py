"""In-process link emulation for hosts without root: a token bucket per emulated
machine, shared by all of that machine's processes through a small file under
/dev/shm (fcntl-locked), applied to bytes sent to other machines.

Only uploads are paced (a NIC's receive side is not), and pacing happens before a
send is issued, so this is coarser than `tc` in network namespaces; use netns for
benchmarks, this for tests and laptops. Hand-written because no maintained library
offers a cross-process token bucket; it is 40 lines.
"""
from __future__ import annotations

import fcntl
import os
import struct
import time
from pathlib import Path

_FMT = "dd"  # tokens (bytes, may go negative = debt), last refill time


class SharedTokenBucket:
    def __init__(self, path: str | Path, rate: float, burst: float | None = None):
        self.path = Path(path)
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(64 * 1024, rate / 100))
        self.consumed = 0  # bytes this process charged to the link (its own share of the machine's)
        self.waited_s = 0.0  # seconds this process was held back
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            if os.fstat(self._fd).st_size < struct.calcsize(_FMT):
                os.pwrite(self._fd, struct.pack(_FMT, self.burst, time.monotonic()), 0)

    def _locked(self):
        bucket = self

        class _Lock:
            def __enter__(self):
                fcntl.flock(bucket._fd, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                fcntl.flock(bucket._fd, fcntl.LOCK_UN)

        return _Lock()

    def consume(self, nbytes: int) -> float:
        """Take nbytes; sleep until the link could have carried them. Returns the wait."""
        with self._locked():
            tokens, last = struct.unpack(_FMT, os.pread(self._fd, struct.calcsize(_FMT), 0))
            now = time.monotonic()
            tokens = min(self.burst, tokens + (now - last) * self.rate) - nbytes
            os.pwrite(self._fd, struct.pack(_FMT, tokens, now), 0)
        wait = -tokens / self.rate if tokens < 0 else 0.0
        self.consumed += nbytes
        self.waited_s += wait
        if wait > 0:
            time.sleep(wait)
        return wait

    def close(self) -> None:
        os.close(self._fd)


def bucket_for(machine: str, rate: float) -> SharedTokenBucket | None:
    """The bucket of `machine` when the launcher asked for rate limiting, else None."""
    folder = os.environ.get("HETRAIN_RATELIMIT_DIR")
    if not folder:
        return None
    return SharedTokenBucket(Path(folder) / f"{machine}.bucket", rate)
