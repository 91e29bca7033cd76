"""Emulated compute devices: a device of speed s ≤ 1 sleeps (1/s − 1) × the measured
compute time after each real forward/backward, so slow devices cost wall time but no
CPU. The speed can follow a schedule in the cluster file or be changed by an
operator writing a number into `<run_dir>/speed/<machine>` (interference emulation).

On a small shared host the real compute of a step is noisy (other processes steal the
cores), so benchmarks can pass `cost_per_sample`: a calibrated device model where a
step of b samples takes b × cost_per_sample / speed seconds (the real compute counts
toward that, sleep makes up the rest). Tests and benchmarks say when they use it.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError
from .spec import DeviceSpec


class DeviceMemoryError(UserError):
    """A batch share larger than the emulated device's memory cap."""


class EmulatedDevice:
    def __init__(self, spec: DeviceSpec, machine: str = "", run_dir: str | None = None,
                 cost_per_sample: float | None = None):
        self.spec = spec
        self.cost_per_sample = cost_per_sample
        self.machine = machine
        self.override = Path(run_dir) / "speed" / machine if run_dir and machine else None
        self.step = 0
        self.compute_s = 0.0  # real compute + emulated slowdown
        self.real_s = 0.0
        self.slept_s = 0.0  # the emulated slowdown asked of time.sleep (it may sleep a little longer)
        self.last_s = 0.0  # the last step's compute (what the balancer measures)
        self.last_speed = 1.0  # the speed the last step ran at
        self.last_sleep_s = 0.0

    def speed(self) -> float:
        if self.override is not None and self.override.is_file():
            try:
                value = float(self.override.read_text().strip())
                if 0 < value <= 1:
                    return value
            except ValueError:
                pass
        return self.spec.speed_at(self.step)

    def check_memory(self, samples: int, bytes_per_sample: float, reserved: float = 0.0) -> None:
        """Refuse a batch that would not fit in this device's memory cap (emulated OOM);
        without a `memory` override the real device enforces its own memory."""
        need = reserved + samples * bytes_per_sample
        if self.spec.memory is not None and need > self.spec.memory:
            raise DeviceMemoryError(
                f"machine {self.machine or '?'}: a batch of {samples} samples needs {need / 2**20:.1f} MiB but the "
                f"device has {self.spec.memory / 2**20:.1f} MiB; lower its share (the balancer caps shares by memory)")

    @contextmanager
    def compute(self, samples: int | None = None):
        """Time the enclosed real compute, then stretch it to this device's speed (or,
        with `cost_per_sample`, to samples × cost_per_sample / speed)."""
        t0 = time.perf_counter()
        yield
        real = time.perf_counter() - t0
        s = self.speed()
        if self.cost_per_sample is not None and samples is not None:
            sleep = max(0.0, samples * self.cost_per_sample / s - real)
        else:
            sleep = real * (1.0 / s - 1.0)
        if sleep > 0:
            time.sleep(sleep)
        self.last_speed, self.last_sleep_s = s, sleep
        self.slept_s += sleep
        self.real_s += real
        self.last_s = time.perf_counter() - t0
        self.compute_s += self.last_s
        self.step += 1
