"""Atomic checkpoints: write to a temporary file in the same folder, fsync, rename.
A crash mid-write leaves the previous checkpoint intact, so no accepted update that
was checkpointed is ever lost. `CommitStore` adds what an elastic job needs: every
file carries a digest of its bytes, so a damaged file is detected and an older one
used (`hetrain.train.elastic` keeps replicas on several machines)."""
from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

import torch

from ..atomicfile import atomic_write
from ..errors import UserError


def save_checkpoint(path: str | Path, state: dict) -> None:
    atomic_write(path, lambda fh: torch.save(state, fh))


def load_checkpoint(path: str | Path) -> dict | None:
    """The last complete checkpoint, or None. Only our own files are loaded, with
    weights_only=True so a tampered file cannot run code."""
    path = Path(path)
    if not path.is_file():
        return None
    return loads(path.read_bytes(), f"checkpoint {path}")


class CheckpointError(UserError):
    """A checkpoint file that cannot be read (truncated, damaged, not ours)."""


class CommitStore:
    """One replica of an elastic job's commits: `<root>/<replica>/commit-<seq>-<digest>.pt`.

    Each file is written atomically (as `save_checkpoint`) and named after the SHA-256 of
    its bytes, so a file that was truncated or damaged after the rename (a torn write on
    storage without atomic rename, a disk error, a careless copy) is detected on reading
    and the previous commit is used; a crash mid-write leaves only a temporary file,
    which is ignored. The newest `keep` commits are kept.
    """

    PATTERN = re.compile(r"^commit-(\d{9})-([0-9a-f]{16})\.pt$")

    def __init__(self, root: str | Path, replica: str, keep: int = 2):
        self.dir = Path(root) / replica
        self.keep = keep
        self.damaged: list[Path] = []  # files found damaged by the last `newest()`

    def save(self, seq: int, data: bytes) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"commit-{seq:09d}-{hashlib.sha256(data).hexdigest()[:16]}.pt"
        atomic_write(path, lambda fh: fh.write(data))
        for old in self._files()[self.keep:]:
            old[2].unlink(missing_ok=True)
        for stale in self.dir.glob(".commit-*"):  # temporaries of a writer that crashed
            stale.unlink(missing_ok=True)
        return path

    def _files(self) -> list[tuple[int, str, Path]]:
        """(seq, digest, path), newest first."""
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = self.PATTERN.match(p.name)
            if m:
                out.append((int(m.group(1)), m.group(2), p))
        return sorted(out, reverse=True)

    def newest(self) -> tuple[int, bytes] | None:
        """The newest intact commit (seq, bytes), skipping damaged files."""
        self.damaged = []
        for seq, digest, path in self._files():
            try:
                data = path.read_bytes()
            except OSError:
                self.damaged.append(path)
                continue
            if hashlib.sha256(data).hexdigest()[:16] == digest:
                return seq, data
            self.damaged.append(path)
        return None


def dumps(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def loads(data: bytes, what: str = "commit") -> dict:
    """Load our own serialised state; weights_only=True, so bytes that are not plain
    tensors and containers cannot run code."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{what} cannot be read ({type(err).__name__}: {err}); it is damaged or not a "
                              "hetrain checkpoint") from None
