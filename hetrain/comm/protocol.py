"""The per-step header every rank (workers and servers) all-reduces before data moves.

One int64 SUM all-reduce of [Σd, Σd², Σweight, Σstop, Σworkers, Σnumel] tells every
rank, servers included: whether the workers agree on the tensors (n·Σd² = (Σd)²),
the total batch weight for weighted averaging, and whether the job is ending.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import Manifest, TensorMismatchError, describe_mismatch, exchange_manifests

STOP, STEP = 1, 0


@dataclass(frozen=True)
class Header:
    digest_sum: int
    digest_sq: int
    weight: int
    stops: int
    workers: int
    numel: int

    @property
    def agreed(self) -> bool:
        return self.workers > 0 and self.workers * self.digest_sq == self.digest_sum**2

    @property
    def digest(self) -> int:
        return self.digest_sum // max(self.workers, 1)

    @property
    def numel_each(self) -> int:
        """Elements each worker pushes (equal on all workers once `agreed`)."""
        return self.numel // max(self.workers, 1)


def exchange_header(*, digest: int = 0, weight: int = 0, stop: bool = False, numel: int = 0,
                    is_worker: bool) -> Header:
    w = 1 if is_worker else 0
    t = torch.tensor([digest * w, digest * digest * w, weight * w, int(stop) * w, w, numel * w], dtype=torch.int64)
    dist.all_reduce(t)
    return Header(*(int(x) for x in t.tolist()))


def check_header(h: Header, n_workers: int, manifest: Manifest | None) -> None:
    """Raise the same clear error on every rank when the workers disagree."""
    if h.workers != n_workers:  # pragma: no cover - world mismatch is caught at init
        raise RuntimeError(f"expected {n_workers} workers in the step header, got {h.workers}")
    if 0 < h.stops < n_workers:
        raise TensorMismatchError(
            f"{h.stops} of {n_workers} workers ended the job while the others called push_pull: every worker "
            "must run the same number of steps (use equal step counts per epoch, e.g. hetrain's sampler)")
    if not h.agreed:
        manifests = exchange_manifests(manifest)
        workers = {r: m for r, m in enumerate(manifests) if m is not None}
        raise TensorMismatchError(describe_mismatch(workers))
