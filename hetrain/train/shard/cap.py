"""A memory cap that holds: each worker is kept to the bytes its (emulated) device has.

- GPU: `torch.cuda.set_per_process_memory_fraction(cap / total)`, so the caching
  allocator itself refuses (CUDA out of memory) an allocation beyond the cap; the peak is
  `torch.cuda.max_memory_allocated` above what was allocated when the cap was set.
- CPU: there is no per-process allocator limit in PyTorch, and RLIMIT_AS counts address
  space (libraries, thread stacks, the gloo buffers' reservations), not memory; so the
  cap is a *checked budget* on the process's resident set: the peak is the kernel's
  high-water mark of resident memory (`VmHWM` of /proc/self/status, reset to the current
  resident size when the cap starts by writing 5 to /proc/self/clear_refs) above the
  resident size at that moment. `check()` (called by the sharded optimizer in backward
  and at every step) raises `MemoryCapError` once that peak has passed the cap, so an
  overflow between two checks is still caught: the high-water mark remembers it.
  Resident memory counts what the C heap keeps, so the bench runs its workers with
  glibc's heap handing large blocks back (`MALLOC_MMAP_THRESHOLD_`, see bench/shard.py).

Start the cap before the model is built, so the model's own parameters count, and early
in the process: memory the C heap took back from earlier work and hands out again does
not grow the resident set, so a cap started late under-counts by what the heap holds free.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import UserError


class MemoryCapError(UserError):
    """A worker went past its memory cap."""


def _status_kib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1]) * 1024
    raise UserError(f"/proc/self/status has no {field}; the CPU memory cap needs Linux")


class MemoryCap:
    def __init__(self, cap_bytes: float, device: torch.device | str = "cpu", name: str = "") -> None:
        if not cap_bytes > 0:
            raise UserError(f"a memory cap of {cap_bytes} bytes cannot hold anything; give a positive size")
        self.cap_bytes = float(cap_bytes)
        self.device = torch.device(device)
        self.name = name or str(self.device)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            if self.cap_bytes < total:
                torch.cuda.set_per_process_memory_fraction(self.cap_bytes / total, self.device)
        self.reset()

    def reset(self) -> None:
        """Start measuring from now (CPU: the high-water mark restarts at the resident size)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks cached by earlier work would count against the fraction
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = float(torch.cuda.memory_allocated(self.device))
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError as e:
            raise UserError(f"cannot reset the resident-memory high-water mark ({e}); the CPU cap needs Linux") from e
        self.base = _status_kib("VmRSS")

    def peak(self) -> float:
        """Bytes above the start at the highest point so far."""
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device)) - self.base
        return _status_kib("VmHWM") - self.base

    def check(self, where: str = "") -> None:
        peak = self.peak()
        if peak > self.cap_bytes:
            raise MemoryCapError(
                f"{self.name}: memory peaked at {peak / 2**20:.1f} MiB ({where}), above its cap of "
                f"{self.cap_bytes / 2**20:.1f} MiB; give it a smaller share (ShardConfig.weights / memory_bytes), "
                "a higher stage or a smaller batch")
