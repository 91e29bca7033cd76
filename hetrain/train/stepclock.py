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

import torch

__all__ = ["StepClock", "Mark"]

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
