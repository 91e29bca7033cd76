"""How much memory a worker's device really has free (the device itself is
`hetrain.device()`, bound by `hetrain.runtime.devices`).

`memory_limit(device)` measures what the device can still hold, so batch shares are
capped by the hardware rather than by a number typed into the cluster file:

- GPU: `torch.cuda.mem_get_info` (free bytes on that GPU, as the driver reports them);
- CPU: the smallest of what the process's control group still allows (cgroup v2
  `memory.max - memory.current`, or v1 `memory.limit_in_bytes - memory.usage_in_bytes`,
  checked up the hierarchy), what RLIMIT_AS still allows above the current address space,
  and the host's `MemAvailable`. Whichever binds is reported as the source.

These read the kernel's own files (/proc, /sys/fs/cgroup): device facts, not data.
The CUDA calls are isolated in the two `_cuda_*` helpers and run only where
`torch.cuda.is_available()`.

`SavedTensorCounter` counts what a forward keeps for backward: the one count behind the
planner's activation profile and a run's measured activation memory.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

Source = Literal["cluster file", "cuda", "cgroup", "rlimit", "ram", "unknown"]
SOURCES: tuple[str, ...] = ("cluster file", "cuda", "cgroup", "rlimit", "ram", "unknown")


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes this device can still hold for training, and which limit binds."""

    bytes: float
    source: Source
    detail: str = ""


def _cuda_free_bytes(device: torch.device) -> tuple[float, str]:
    free, total = torch.cuda.mem_get_info(device)
    return float(free), f"{torch.cuda.get_device_name(device)}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"


def _cuda_describe(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def describe_device(device: torch.device) -> str:
    """`cuda:0 (NVIDIA H100 ...)` or `cpu (4 threads)`, for summaries."""
    if device.type == "cuda":
        return f"{device} ({_cuda_describe(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def _read_int(path: Path) -> float | None:
    """A cgroup limit file: a number of bytes, or 'max' / a huge value meaning no limit."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return float("inf")
    try:
        value = float(text)
    except ValueError:
        return None
    return float("inf") if value >= 2**62 else value


def _cgroup_paths(proc: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 memory-controller path."""
    v2 = v1 = None
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _walk(root: Path, rel: str | None):
    """The cgroup directory of this process and its ancestors up to the mount root
    (inside a cgroup namespace the mount root is the process's own group)."""
    dirs = []
    if rel:
        d = root / rel.lstrip("/")
        while True:
            if d.is_dir():
                dirs.append(d)
            if d == root or root not in d.parents:
                break
            d = d.parent
    if root.is_dir() and root not in dirs:
        dirs.append(root)
    return dirs


def cgroup_remaining(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc")) -> tuple[float, str] | None:
    """Bytes the process's memory cgroup still allows (the tightest level), or None."""
    v2, v1 = _cgroup_paths(proc)
    best = None
    candidates = []
    for d in _walk(root, v2):
        candidates.append((d / "memory.max", d / "memory.current"))
    for d in _walk(root / "memory", v1):
        candidates.append((d / "memory.limit_in_bytes", d / "memory.usage_in_bytes"))
    for limit_file, usage_file in candidates:
        limit = _read_int(limit_file)
        if limit is None or limit == float("inf"):
            continue
        usage = _read_int(usage_file) or 0.0
        left = max(0.0, limit - usage)
        if best is None or left < best[0]:
            best = (left, f"{limit_file}: {limit / 2**30:.1f} GiB, {usage / 2**30:.1f} GiB used")
    return best


def rlimit_remaining(proc: Path = Path("/proc")) -> tuple[float, str] | None:
    """Bytes RLIMIT_AS still allows above the current address space, or None."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0.0
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("VmSize:"):
                used = float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(0.0, soft - used), f"RLIMIT_AS {soft / 2**30:.1f} GiB, {used / 2**30:.1f} GiB mapped"


def ram_available(proc: Path = Path("/proc")) -> tuple[float, str] | None:
    """The host's MemAvailable (what can be allocated without swapping), or None."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                value = float(line.split()[1]) * 1024
                return value, f"MemAvailable {value / 2**30:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        value = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        return value, f"free pages {value / 2**30:.1f} GiB"
    except (ValueError, OSError):
        return None


def cpu_memory_limit(cgroup_root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc")) -> MemoryLimit:
    """Host memory this process can still use: the binding one of cgroup, RLIMIT_AS, RAM."""
    found = [(src, v) for src, v in (("cgroup", cgroup_remaining(cgroup_root, proc)),
                                     ("rlimit", rlimit_remaining(proc)),
                                     ("ram", ram_available(proc))) if v is not None]
    if not found:
        return MemoryLimit(float("inf"), "unknown", "no memory limit could be read")
    src, (value, detail) = min(found, key=lambda x: x[1][0])
    return MemoryLimit(value, src, detail)


def memory_limit(device: torch.device) -> MemoryLimit:
    """Free bytes on `device` (GPU: the driver's free memory; CPU: see cpu_memory_limit)."""
    if device.type == "cuda":
        free, detail = _cuda_free_bytes(device)
        return MemoryLimit(free, "cuda", detail)
    return cpu_memory_limit()


def engine_device_bytes(numel: int, codec: bool) -> float:
    """GPU bytes hetrain's own push_pull buffers take for `numel` gradient elements (the
    stagings of comm/cuda.py), at most: an fp32 work or gather buffer; with a codec also its
    error-feedback residual and the encoded payload (at most fp32 wide). Counted with the
    model's state, so a batch share never claims the memory the engine needs."""
    return 4.0 * numel * (3 if codec else 1)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (GPU kernels run asynchronously: a clock read
    on the host says nothing about them until they are done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SavedTensorCounter:
    """Bytes autograd keeps for backward inside a `with` block, the one count both the
    planner's profiler and the run's `ActivationMeter` use, so prediction and measurement
    count the same thing: every tensor the graph saves (through
    `torch.autograd.graph.saved_tensors_hooks`), each once however many nodes save it (a
    ReLU's output is also the next layer's input), leaving out tensors whose storage is a
    parameter's (saved for the weight gradient, yet held by the model state already).
    The same count on any device, with no CUDA memory statistics."""

    def __init__(self, params=()) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._seen: set[tuple] = set()
        self.total = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if ptr not in self._params and key not in self._seen:
            self._seen.add(key)
            self.total += t.numel() * t.element_size()
        return t

    def __enter__(self) -> "SavedTensorCounter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._seen.clear()  # keep no references to the step's tensors


def estimate_memory_per_sample(model: torch.nn.Module, example) -> float:
    """Bytes of activations one sample produces in a forward pass (×2: their gradients),
    measured with forward hooks on the leaf modules for a batch of one."""
    total = [0]

    def hook(_m, _inp, out):
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor):
                total[0] += o.numel() * o.element_size()

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook) for m in leaves]
    inputs = example if isinstance(example, (tuple, list)) else (example,)
    inputs = tuple(x[:1] for x in inputs)
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return 2.0 * (total[0] + sum(x.numel() * x.element_size() for x in inputs))
