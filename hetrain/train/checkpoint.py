"""Atomic checkpoints: write to a temporary file in the same folder, fsync, rename.
A crash mid-write leaves the previous checkpoint intact, so no accepted update that
was checkpointed is ever lost."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def save_checkpoint(path: str | Path, state: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path) -> dict | None:
    """The last complete checkpoint, or None. Only our own files are loaded, with
    weights_only=True so a tampered file cannot run code."""
    path = Path(path)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
