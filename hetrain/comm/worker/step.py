"""One push_pull in flight: its book-keeping, who owns it, this worker's weighting, and
the per-worker accounting of the step summary."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...errors import UserError
from ..layout import Manifest, wide_floats
from ..protocol import Announcer, ControlExchange
from ..staging import Staging
from ..transport import Transport


@dataclass
class CommStats:
    """Per-worker accounting for the step summary (seconds and bytes)."""

    steps: int = 0
    comm_s: float = 0.0  # moving partitions (or all-reduce)
    wait_s: float = 0.0  # waiting for the other workers (the step header)
    hidden_s: float = 0.0  # communication that ran while backward was still computing
    bytes_sent: int = 0  # bytes on the wire (encoded payloads when a codec is used)
    bytes_received: int = 0
    per_step: list[dict] = field(default_factory=list)

    def account(self, wait_s: float, comm_s: float, moved: int, hidden_s: float, received: int | None = None) -> None:
        """One exchange done: add its times and bytes (`received`: `moved` unless given)."""
        received = moved if received is None else received
        self.steps += 1
        self.wait_s += wait_s
        self.comm_s += comm_s
        self.hidden_s += hidden_s
        self.bytes_sent += moved
        self.bytes_received += received
        self.per_step.append({"wait_s": wait_s, "comm_s": comm_s, "hidden_s": hidden_s, "bytes": moved + received})


class ExchangeOwner(Protocol):
    """Whoever begins an exchange that others may need the engine before it ends (a
    DistributedOptimizer overlapping its exchange with backward): `complete_exchange`
    finishes it, writing its results where its owner reads them."""

    def complete_exchange(self) -> None: ...


@dataclass
class _Step:
    """Book-keeping of one push_pull in flight."""

    staging: Staging
    wait_s: float
    t_begin: float
    done: list[bool]
    covered: list[int]  # elements handed over per tensor (ready() may come in ranges)
    overlapped: bool = False
    control: ControlExchange | None = None  # this step's announcement, answers not yet read
    manifest: Manifest | None = None
    weight: int = 0
    average: bool = True
    total: int = -1  # Σ batch weights (from the header, or the servers' answers in finish)
    owner: ExchangeOwner | None = None  # who began it and can complete it (see PushPull.begin)
    header: Callable[[], int] | None = None  # a speculated step's header wait: Σb, read in finish
    # the transport is driven by tensors handed over (at most every engine.POLL_S), not only
    # at a completed partition: the staging's copies finish asynchronously (CUDA); so does
    # the transport's own work while its `polls` says so (local reduces in flight)
    polls: bool = False
    poll_at: float = 0.0  # perf_counter() from which the next such pass is due


class _LazyScale:
    """This worker's factor b_i / Σb (1 to sum), known once the step header is in:
    calling it waits for the header (the first time only) and checks it."""

    def __init__(self, wait, weight: int, average: bool, denominator: int | None = None):
        self.wait, self.weight, self.average = wait, weight, average
        self.denominator = denominator  # the caller's total, when it gave one (see PushPull.begin)
        self.value: float | None = None
        self.total = -1

    def __call__(self) -> float:
        if self.value is None:
            self.total = self.wait()
            if self.average and self.total == 0:
                raise UserError("every worker pushed with weight 0: at least one worker needs a non-empty batch")
            self.value = (self.weight / (self.denominator or self.total)) if self.average else 1.0
        return self.value


@dataclass
class Weighing:
    """How this worker's share enters a step (see `weigh`)."""

    scale: float | _LazyScale  # the factor the staging applies while filling (or its lazy form)
    control: ControlExchange | None = None  # the servers' announcement, answers read in finish
    total: int = -1  # Σ batch weights, where already known
    header: Callable[[], int] | None = None  # a speculated step's header wait: Σb, read in finish


def weigh(transport: Transport, protocol: Announcer, named: list[tuple[str, torch.Tensor]], device: torch.device,
          manifest: Manifest, digest: int, weight: int, average: bool, total: int | None,
          speculate: bool) -> Weighing:
    """Start the step protocol and say how this worker's gradients are scaled (the cases
    of `PushPull.begin`): in all-reduce mode each worker scales its own share b_i / Σb
    (known at once from `total`, speculated, read lazily at the first bucket, or agreed
    now); with summation servers the announcement tells them b_i and they weight it."""
    if transport.weighs_itself:  # workers scale their own share
        if total is not None and average and digest == protocol.digest:
            if total < 1 or weight > total:
                raise UserError(f"push_pull total={total} must be >= 1 and >= this worker's weight {weight}")
            return Weighing(weight / total)  # the agreed layout and a known total: no header
        if speculate and digest == protocol.digest and wide_floats(named):  # Σb read in finish
            header = protocol.header_start(manifest, weight, digest)
            return Weighing(float(weight) if average else 1.0, header=header)
        if device.type == "cpu" and digest == protocol.digest:
            wait = protocol.header_start(manifest, weight, digest)
            # the agreed layout: read the header at the first bucket (it runs meanwhile)
            return Weighing(_LazyScale(wait, weight, average, total))
        # a new layout (or a device staging that scales while filling): agree now
        return Weighing(_LazyScale(protocol.header_start(manifest, weight, digest), weight, average, total)())
    # the servers weight each machine's push (they learn b_i from the announcement)
    control, agreed_total = protocol.announce(manifest, weight, average)
    # several workers on a machine add b_l·g_l locally; the servers divide by Σb
    scale = float(weight if average else 1) if transport.machine_sum else 1.0
    return Weighing(scale, control=control, total=agreed_total)
