"""How a step starts: the workers' announcement to the servers, and the full header.

Every step each worker tells each server, in one direct message, what it pushes (see
"the fast path" below). When that is not enough (the first step, a new layout,
disagreeing workers, a partial stop) every rank, servers included, all-reduces one int64
header [Σd, Σd², Σweight, Σstop, Σworkers, Σnumel, Σconflict], which tells whether the
workers agree on the tensors (n·Σd² = (Σd)²), the total batch weight, whether the job
ends, and (from the servers) whether the workers of one machine disagree on averaging.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from . import p2p
from .known import KnownLayouts
from .layout import Manifest, TensorMismatchError, describe_mismatch, exchange_manifests

HEADER_LEN = 7


@dataclass(frozen=True)
class Header:
    digest_sum: int
    digest_sq: int
    weight: int
    stops: int
    workers: int
    numel: int
    conflict: int = 0  # Σ over servers of (1 + index of a machine whose workers disagree on `average`)

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
                    is_worker: bool, conflict: int = 0, group=None) -> Header:
    """All-reduce the header over `group` (default: every rank of the job)."""
    return start_header(digest=digest, weight=weight, stop=stop, numel=numel, is_worker=is_worker,
                        conflict=conflict, group=group)()


def start_header(*, digest: int = 0, weight: int = 0, stop: bool = False, numel: int = 0,
                 is_worker: bool, conflict: int = 0, group=None) -> Callable[[], Header]:
    """Start the header's all-reduce; the returned `wait()` gives the Header."""
    w = 1 if is_worker else 0
    t = torch.tensor([digest * w, digest * digest * w, weight * w, int(stop) * w, w, numel * w, conflict],
                     dtype=torch.int64)
    work = dist.all_reduce(t, group=group, async_op=True)

    def wait() -> Header:
        work.wait()
        return Header(*(int(x) for x in t.tolist()))

    return wait


def check_header(h: Header, n_workers: int, manifest: Manifest | None, n_servers: int = 1,
                 machine_names: Sequence[str] = (), group=None, host_group=None) -> None:
    """Raise the same clear error on every rank when the workers disagree. With `group`
    (a `comm.group.Group`) the header and the manifests are the group's, and the error
    names the group and its members by their job ranks. `host_group`: the job's host group
    (Context.host_group) for the whole job's manifests."""
    if h.workers != n_workers:  # pragma: no cover - world mismatch is caught at init
        raise RuntimeError(f"expected {n_workers} workers in the step header, got {h.workers}")
    if 0 < h.stops < n_workers:
        raise TensorMismatchError(
            f"{h.stops} of {n_workers} workers ended the job while the others called push_pull: every worker "
            "must run the same number of steps (use equal step counts per epoch, e.g. hetrain's sampler)")
    if h.conflict:
        m = h.conflict // max(1, n_servers) - 1
        name = machine_names[m] if 0 <= m < len(machine_names) else f"#{m}"
        raise TensorMismatchError(
            f"the workers of machine {name} called push_pull with different `average` flags in one step; the "
            "workers of a machine add their gradients before the servers see them, so they must all average "
            "or all sum")
    if not h.agreed:
        if group is None:
            manifests = exchange_manifests(manifest, host_group)
            workers = {r: m for r, m in enumerate(manifests) if m is not None}
            raise TensorMismatchError(describe_mismatch(workers))
        manifests = exchange_manifests(manifest, group.gloo)
        workers = {group.global_rank(i): m for i, m in enumerate(manifests) if m is not None}
        raise TensorMismatchError(describe_mismatch(workers, scope=group.describe()))


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
CTRL_TAG, REPLY_TAG = p2p.ANNOUNCE(0), p2p.ANNOUNCE(1)
CTRL_VERSION = 1
CTRL_LEN = 6
OK, SLOW, STOPPED = 0, 1, 2
MAX_PARTITIONS = 1 << 21
MAX_EPOCHS = 1000  # tags stay below 2**31; after that many layouts, no more speculation


def part_tag(epoch: int, pid: int) -> int:
    """The tag of partition `pid` under layout `epoch`: one block of MAX_PARTITIONS tags
    per layout while speculating, block 0 afterwards (p2p.PARTITIONS)."""
    return p2p.PARTITIONS(MAX_PARTITIONS * (epoch if speculating(epoch) else 0) + pid)


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
        self.recvs = [p2p.irecv(r, src=s, tag=REPLY_TAG) for r, s in zip(self.replies, servers)]
        self.sends = [p2p.isend(self.msg, dst=s, tag=CTRL_TAG) for s in servers]

    def wait(self) -> list[Reply]:
        for w in self.sends + self.recvs:
            w.wait()
        return [Reply(int(r[0]), int(r[1])) for r in self.replies]


# how long a server waits for the next step's announcements: the workers may train for
# any time without it (a balanced job whose steps leave a worker out exchange among their
# workers only: hetrain.api.members), and a lost worker is found by the launcher's
# liveness, which stops the job, not by this wait; the bound is a backstop only
IDLE_WAIT = timedelta(hours=24)


class ControlInbox:
    """Server side: the next step's control messages, one receive per worker, posted as
    soon as the previous ones arrived so no step waits for a receive to be posted."""

    def __init__(self, workers: list[int]):
        self.workers = workers
        self.bufs = torch.zeros(len(workers), CTRL_LEN, dtype=torch.int64)
        self._post()

    def _post(self) -> None:
        self.works = [p2p.irecv(self.bufs[i], src=w, tag=CTRL_TAG) for i, w in enumerate(self.workers)]

    def wait(self, on_error) -> torch.Tensor:
        """All workers' messages (one row each); `on_error(worker, err)` names a lost peer.
        Call `repost` once the job goes on (not after the last step: no receive may be
        left pending at teardown)."""
        for w, work in zip(self.workers, self.works):
            try:
                work.wait(IDLE_WAIT)
            except RuntimeError as err:
                raise on_error(w, err) from None
        return self.bufs.clone()

    def repost(self) -> None:
        self._post()

    @staticmethod
    def verdict(rows: torch.Tensor, digest: int, conflict: int = -1) -> int:
        """OK when every worker pushes the layout the servers already hold; STOPPED when
        all end the job; SLOW for everything else (the header path sorts it out)."""
        if bool((rows[:, 0] != CTRL_VERSION).any()):
            return SLOW
        stops = int(rows[:, 4].sum())
        if stops == len(rows):
            return STOPPED
        if stops == 0 and conflict < 0 and digest != 0 and bool((rows[:, 1] == digest).all()):
            return OK
        return SLOW

    @staticmethod
    def coefficients(rows: torch.Tensor, machines: Sequence[Sequence[int]]) -> tuple[torch.Tensor, int]:
        """Each pusher's factor in the sum, one per machine (rows of `machines`, by worker
        index), and the index of a machine whose workers disagree on averaging (-1: none).

        A machine with one worker pushes its gradient as is: factor b_i / Σb when it
        averages (0 when every batch is empty: the workers raise), 1 for a plain sum. A
        machine with several workers pushes the local sum of b_l·g_l (averaging) or of g_l,
        so its factor is 1/Σb or 1."""
        weight, average = rows[:, 3].double(), rows[:, 5].bool()
        total = float(weight.sum())
        out, conflict = [], -1
        for m, idx in enumerate(machines):
            avg = {bool(average[i]) for i in idx}
            if len(avg) > 1 and conflict < 0:
                conflict = m
            if not any(avg):
                out.append(1.0)
            elif len(idx) == 1:
                out.append(float(weight[idx[0]]) / total if total > 0 else 0.0)
            else:
                out.append(1.0 / total if total > 0 else 0.0)
        return torch.tensor(out, dtype=torch.float32), conflict

    def answer(self, status: int, weight: int) -> list:
        reply = torch.tensor([status, weight], dtype=torch.int64)
        return [(w, p2p.isend(reply, dst=w, tag=REPLY_TAG)) for w in self.workers]


class Announcer:
    """Worker side of the step protocol: announce each step to the servers (or, without
    servers, all-reduce the header), take the header path when the servers ask for it, and
    keep the layout every rank agreed on (its digest and epoch). `on_layout(manifest, left)`
    is called when another layout has been agreed (`left`: the digest of the one left, 0
    at first), before any partition of it is sent. With
    `group` (a `comm.group.Group`, no servers) the header is the group's alone."""

    def __init__(self, ctx, servers: list[int], on_layout: Callable[[Manifest, int], None], group=None):
        self.ctx = ctx
        self.group = group
        if group is not None and servers:
            raise ValueError("a group engine all-reduces among its members; it has no summation servers")
        self.servers = servers
        self.on_layout = on_layout
        self.digest = 0
        self.epoch = 0  # the layout's block of partition tags (comm/known.py)
        self.known: KnownLayouts = KnownLayouts()  # the engine keeps its per-layout state here
        machines = ctx.topology.worker_machines if ctx.topology else [[0]]
        self.machine_names = [ctx.topology.proc(r[0]).machine.name for r in machines] if ctx.topology else ["w0"]

    def announce(self, manifest: Manifest, weight: int, average: bool) -> tuple[ControlExchange | None, int]:
        """Send this step's control message to every server. With an unchanged layout the
        servers already hold receives for it, so return at once (read the answers, with
        Σb, with `answers`); otherwise wait for them and take the header path, which gives
        Σb now."""
        digest = manifest.digest()
        try:
            control = ControlExchange(self.servers, digest=digest, numel=manifest.numel, weight=weight,
                                      stop=False, average=average)
            if digest == self.digest and speculating(self.epoch):
                return control, -1
            replies = control.wait()
        except RuntimeError as err:
            raise self.ctx.peer_error("announcing the step to the summation servers", [], err) from None
        status = {r.status for r in replies}
        if status == {OK}:  # unchanged layout, not speculating (after MAX_EPOCHS layouts)
            return control, -1
        if status != {SLOW}:  # pragma: no cover - servers decide alike
            self.ctx.failed = True
            raise RuntimeError(f"summation servers answered a new layout with {replies}")
        return None, self.header(manifest, weight)

    def answers(self, control: ControlExchange, manifest: Manifest, weight: int) -> int:
        """The servers' verdict on a step announced without waiting; anything but OK means
        the workers disagree, and the header path says how, on every rank. Returns Σb."""
        try:
            replies = control.wait()
        except RuntimeError as err:
            raise self.ctx.peer_error("waiting for the summation servers' answer", [], err) from None
        status = {r.status for r in replies}
        if status == {SLOW}:
            self.header(manifest, weight)  # raises the mismatch on every rank
        if status != {OK}:  # pragma: no cover - servers decide alike
            self.ctx.failed = True
            raise RuntimeError(f"summation servers disagree about the step: {replies}")
        return replies[0].weight

    def header(self, manifest: Manifest, weight: int) -> int:
        """The global step header (every rank): new layouts, mismatches and stops."""
        return self.header_start(manifest, weight)()

    def header_start(self, manifest: Manifest, weight: int, digest: int | None = None) -> Callable[[], int]:
        """Start the step header; `wait()` checks it and returns Σweight. A worker whose
        layout is the agreed one may start it and go on (all-reduce mode: the header then
        runs during forward and is read at the first bucket); the check, and a new
        layout, happen at `wait()` on every rank alike, before any bucket of the step."""
        ctx, g = self.ctx, self.group
        where = "exchanging the step header" + (f" of {g.describe()}" if g is not None else "")
        peers = [r for r in g.ranks if r != ctx.rank] if g is not None else []
        try:
            pending = start_header(digest=digest or manifest.digest(), weight=weight, numel=manifest.numel,
                                   is_worker=True, group=g.gloo if g is not None else ctx.host_group)
        except RuntimeError as err:
            raise ctx.peer_error(where, peers, err) from None

        def wait() -> int:
            try:
                h = pending()
            except RuntimeError as err:
                raise ctx.peer_error(where, peers, err) from None
            return self._agree(h, manifest)

        return wait

    def _agree(self, h: Header, manifest: Manifest) -> int:
        ctx, g = self.ctx, self.group
        self._check(h, manifest)
        if h.digest != self.digest:
            epoch, known = self.known.switch(h.digest)
            if not known:  # the servers learn the new layout's tensors (a known one they kept)
                exchange_manifests(manifest, g.gloo if g is not None else ctx.host_group)
            left, self.digest, self.epoch = self.digest, h.digest, epoch
            self.on_layout(manifest, left)
        return h.weight

    def _check(self, h: Header, manifest: Manifest | None) -> None:
        try:
            n = self.group.size if self.group is not None else self.ctx.num_workers
            check_header(h, n, manifest, len(self.servers), self.machine_names, self.group,
                         getattr(self.ctx, "host_group", None))
        except TensorMismatchError:
            self.ctx.failed = True
            raise

    def stop(self) -> None:
        """Tell the summation servers the job is over (every worker calls this once)."""
        try:
            replies = ControlExchange(self.servers, digest=0, numel=0, weight=0, stop=True, average=False).wait()
            if {r.status for r in replies} == {STOPPED}:
                return
            # not every worker stops: say so everywhere
            h = exchange_header(stop=True, is_worker=True, group=self.ctx.host_group)
        except RuntimeError as err:
            raise self.ctx.peer_error("telling the servers the job is over", [], err) from None
        self._check(h, None)
