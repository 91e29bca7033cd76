"""How a step starts: the workers' announcement to the servers, and the full header.

Every step each worker tells each server, in one direct message, what it pushes (see
"the fast path" below). When that is not enough (the first step, a new layout,
disagreeing workers, a partial stop) every rank, servers included, all-reduces one int64
header [Σd, Σd², Σweight, Σstop, Σworkers, Σnumel], which tells whether the workers
agree on the tensors (n·Σd² = (Σd)²), the total batch weight, and whether the job ends.
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


# ---- the fast path: one direct control message per worker and server ------------------
# The global all-reduce above is multi-hop (2(P-1) sequential messages over every process
# of the job) and on a loaded link its small messages queue behind gradient bytes; it
# cost 10-25 ms per step on the benchmark cluster. Instead each worker sends
# [version, digest, numel, weight, stop, average] straight to every server (one hop, in
# parallel) and each server answers [status, Σweight]. Anything unusual (first step, a
# new layout, disagreeing workers, a partial stop) answers SLOW and every rank falls
# back to exchange_header, which produces the same clear errors as before.
#
# Servers post the receives of the next step's partitions as soon as a step ends
# (speculating that the layout stays), so a worker whose layout is unchanged sends its
# control message and its partitions at once, without a round trip: gloo only moves a
# message once the receiver has posted it. Partition tags carry the layout's epoch, so a
# step with a new layout never meets the receives posted for the old one.
CTRL_TAG, REPLY_TAG = (1 << 20) + 8, (1 << 20) + 9  # async_ps uses (1 << 20) + 0..2
CTRL_VERSION = 1
CTRL_LEN = 6
OK, SLOW, STOPPED = 0, 1, 2
MAX_PARTITIONS = 1 << 21
MAX_EPOCHS = 1000  # tags stay below 2**31; after that many layouts, no more speculation


def part_tag(epoch: int, pid: int) -> int:
    """The tag of partition `pid` under layout `epoch` (unique per layout while speculating)."""
    return pid if epoch >= MAX_EPOCHS else MAX_PARTITIONS * (1 + epoch) + pid


def speculating(epoch: int) -> bool:
    return 0 < epoch < MAX_EPOCHS


@dataclass(frozen=True)
class Reply:
    status: int
    weight: int


class ControlExchange:
    """Worker side of one step's announcement: sent at once, answers collected later."""

    def __init__(self, servers: list[int], *, digest: int, numel: int, weight: int, stop: bool, average: bool):
        self.servers = servers
        self.msg = torch.tensor([CTRL_VERSION, digest, numel, weight, int(stop), int(average)], dtype=torch.int64)
        self.replies = [torch.zeros(2, dtype=torch.int64) for _ in servers]
        self.recvs = [dist.irecv(r, src=s, tag=REPLY_TAG) for r, s in zip(self.replies, servers)]
        self.sends = [dist.isend(self.msg, dst=s, tag=CTRL_TAG) for s in servers]

    def wait(self) -> list[Reply]:
        for w in self.sends + self.recvs:
            w.wait()
        return [Reply(int(r[0]), int(r[1])) for r in self.replies]


class ControlInbox:
    """Server side: the next step's control messages, one receive per worker, posted as
    soon as the previous ones arrived so no step waits for a receive to be posted."""

    def __init__(self, workers: list[int]):
        self.workers = workers
        self.bufs = torch.zeros(len(workers), CTRL_LEN, dtype=torch.int64)
        self._post()

    def _post(self) -> None:
        self.works = [dist.irecv(self.bufs[i], src=w, tag=CTRL_TAG) for i, w in enumerate(self.workers)]

    def wait(self, on_error) -> torch.Tensor:
        """All workers' messages (one row each); `on_error(worker, err)` names a lost peer.
        Call `repost` once the job goes on (not after the last step: no receive may be
        left pending at teardown)."""
        for w, work in zip(self.workers, self.works):
            try:
                work.wait()
            except RuntimeError as err:
                raise on_error(w, err) from None
        return self.bufs.clone()

    def repost(self) -> None:
        self._post()

    @staticmethod
    def verdict(rows: torch.Tensor, digest: int) -> int:
        """OK when every worker pushes the layout the servers already hold; STOPPED when
        all end the job; SLOW for everything else (the header path sorts it out)."""
        if bool((rows[:, 0] != CTRL_VERSION).any()):
            return SLOW
        stops = int(rows[:, 4].sum())
        if stops == len(rows):
            return STOPPED
        if stops == 0 and digest != 0 and bool((rows[:, 1] == digest).all()):
            return OK
        return SLOW

    @staticmethod
    def coefficients(rows: torch.Tensor) -> torch.Tensor:
        """Each worker's factor in the sum: b_i / Σb for workers that average (0 when
        every batch is empty: the workers raise), 1 for workers that ask for the sum."""
        weight, average = rows[:, 3].double(), rows[:, 5].bool()
        total = float(weight.sum())
        scaled = weight / total if total > 0 else torch.zeros_like(weight)
        return torch.where(average, scaled, torch.ones_like(weight)).float()

    def answer(self, status: int, weight: int) -> list:
        reply = torch.tensor([status, weight], dtype=torch.int64)
        return [(w, dist.isend(reply, dst=w, tag=REPLY_TAG)) for w in self.workers]
