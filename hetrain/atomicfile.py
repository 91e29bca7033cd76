"""Writing a file so that a reader sees the old one or the whole new one, never a part.

One helper for every file hetrain replaces while someone may read it or the writer may
die: checkpoints and elastic commits (`train/checkpoint.py`), a scheduled job's progress
line (`sched/worker.py`). Written to a temporary file in the same folder (a rename is
atomic only within one file system), optionally synced to disk, then renamed over the
target; a temporary left by a failed write is removed."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object], durable: bool = True) -> Path:
    """Write `path` through `write(fh)` atomically. `durable` syncs the bytes to disk before
    the rename, so a crash of the machine cannot leave an empty file under the new name
    (checkpoints need it; a progress line read a moment later does not)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
