"""The emulated device clock of a pipeline process (`Pacer`)."""
from __future__ import annotations

import time


class Pacer:
    """Emulated device clock (wall-clock seconds, shared by the processes of a host).

    Each piece of work occupies the device for exactly its emulated time from the cost
    model, starting when both the device is free and its input is ready: the input's
    ready time travels in the message header (the sender's emulated finish time), so
    the emulation does not depend on when the host happens to schedule the receiver.
    ``begin(ready)``, then ``finish(target)`` returns the emulated finish time (to stamp
    outgoing messages), then ``wait()`` sleeps until it. Real work longer than its slot
    makes the device late (counted in ``over``); shorter real work is hidden.
    """

    def __init__(self, on: bool):
        self.on = on
        self.busy_until = 0.0
        self.ready = 0.0
        self.real_s = 0.0
        self.slept_s = 0.0
        self.over = 0

    def begin(self, ready: float) -> None:
        self.ready = ready
        self.t0 = time.time()

    def finish(self, target: float) -> float:
        if self.on:
            self.busy_until = max(self.busy_until, self.ready) + target
        return self.busy_until

    def wait(self) -> None:
        now = time.time()
        self.real_s += now - self.t0
        if not self.on:
            return
        if self.busy_until > now:
            time.sleep(self.busy_until - now)
            self.slept_s += self.busy_until - now
        else:
            self.over += 1
            self.busy_until = now

    def pad(self, target: float) -> float:
        end = self.finish(target)
        self.wait()
        return end
