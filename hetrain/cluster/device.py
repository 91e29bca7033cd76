"""Emulated compute devices: a device of speed s ≤ 1 sleeps (1/s − 1) × the measured
compute time after each real forward/backward, so slow devices cost wall time but no
CPU (BRIEF §3). The speed can follow a schedule in the cluster file or be changed by an
operator writing a number into `<run_dir>/speed/<machine>` (interference emulation).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from .spec import DeviceSpec


class EmulatedDevice:
    def __init__(self, spec: DeviceSpec, machine: str = "", run_dir: str | None = None):
        self.spec = spec
        self.machine = machine
        self.override = Path(run_dir) / "speed" / machine if run_dir and machine else None
        self.step = 0
        self.compute_s = 0.0  # real compute + emulated slowdown
        self.real_s = 0.0

    def speed(self) -> float:
        if self.override is not None and self.override.is_file():
            try:
                value = float(self.override.read_text().strip())
                if 0 < value <= 1:
                    return value
            except ValueError:
                pass
        return self.spec.speed_at(self.step)

    @contextmanager
    def compute(self):
        """Time the enclosed real compute, then stretch it to this device's speed."""
        t0 = time.perf_counter()
        yield
        real = time.perf_counter() - t0
        s = self.speed()
        if s < 1.0:
            time.sleep(real * (1.0 / s - 1.0))
        self.real_s += real
        self.compute_s += time.perf_counter() - t0
        self.step += 1
