"""How long a worker's step took on its device, read without draining the device's queue.

The balancer needs each step's compute time. On the host the clock is the device's. A GPU
runs its kernels after the host queued them, so a host clock read says nothing about
them until the queue is drained (`torch.cuda.synchronize`); draining it at every step
end left the GPU idle while Python prepared the next step (the loader, the balancer, the
next forward's launches): on a step of a few milliseconds, a large part of it.

So on a CUDA device a step's marks are CUDA events recorded on the device's current
stream (the one the step's kernels and the optimizer's update run on), and its time is
the device's between them (`Event.elapsed_time`): from the device reaching the step's
start (the end of the step before, where the device was still busy with it) to it
reaching the step's end, gaps where it waited for the host included, as a host clock
around a drained queue would count them. The time is read once the end event has
completed (`Event.query`, which does not block), else one step later, when it has
(`Step.seconds(wait=True)` blocks on that event only, not on the work queued after it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["StepClock", "StepRecords", "Mark"]

Mark = object  # a point of a step: host seconds (float), or a recorded CUDA event


@dataclass
class StepClock:
    """Marks on this worker's device: `mark()` now, `seconds(a, b, wait)` between two."""

    device: torch.device

    @property
    def on_device(self) -> bool:
        """Whether marks are events on a CUDA stream (else host clock reads)."""
        return self.device.type == "cuda"

    def mark(self) -> Mark:
        """This point of the step: the host clock, or an event recorded on the device's
        current stream (after every kernel queued so far)."""
        if not self.on_device:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Mark, end: Mark, wait: bool) -> float | None:
        """Seconds from `start` to `end` on the device; None where the device has not
        reached `end` yet and `wait` is False (`wait`: block until it has, on that event
        alone)."""
        if not self.on_device:
            return float(end) - float(start)
        if not end.query():
            if not wait:
                return None
            end.synchronize()
        return start.elapsed_time(end) / 1e3


class StepRecords:
    """Closed steps' compute, handed to `record(samples, seconds)` once each, in order, as
    soon as the device time of each is known; and the metrics row an exchange carries.

    A closed step is (samples, start mark, end mark, comm, wait, hidden, bytes): its marks
    from `clock`, the engine's exchange seconds and bytes in between."""

    def __init__(self, clock: StepClock, record: Callable[[int, float], None]):
        self.clock, self.record = clock, record
        self.late: tuple | None = None  # on a GPU: (the step before, its row or None where not recorded yet)

    def close(self, step: tuple) -> tuple:
        """Record `step`'s compute where its time is known (always on a CPU; on a GPU once
        the device is done with it) and return the metrics row the exchange carries: on a
        CPU `step`'s; on a GPU the step before's (the first step's: zeros, nothing measured
        yet), whose end the device has reached or is about to (waited for: it bounds the
        queue to a step ahead), recorded now where it was not at its own end. No step
        waits for its own device work only to be timed."""
        now = self._row(step, wait=not self.clock.on_device)
        if now is not None:
            self.record(now[0], now[1])
        if not self.clock.on_device:
            return now
        row = self.settle() or (0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self.late = (step, now)
        return row

    def settle(self) -> tuple | None:
        """The step held (GPU), recorded here if its time was not known at its end; its row
        (None: no step held)."""
        if self.late is None:
            return None
        (step, row), self.late = self.late, None
        if row is None:
            row = self._row(step, wait=True)
            self.record(row[0], row[1])
        return row

    def _row(self, step: tuple, wait: bool) -> tuple | None:
        """(samples, compute, comm, wait, hidden, bytes) of a closed step, None where its
        device time is not known yet and `wait` is False. Compute: the step's time on the
        device (from handing out its batch to the end of optimizer.step) less the
        exchange's, at least 0."""
        samples, start, end, comm, wait_s, hidden, nbytes = step
        span = self.clock.seconds(start, end, wait)
        if span is None:
            return None
        return samples, max(0.0, span - comm - wait_s), comm, wait_s, hidden, nbytes
