"""A CUDA stand-in for CPU hosts, with a stream race checker (tests only).

`install()` makes this CPU-only PyTorch look like it has `count` GPUs to the code under
test, which runs unchanged:

- **Device tensors** are CPU tensors whose storage is registered as "on the GPU": the
  Python-visible `Tensor.device` / `Tensor.is_cuda` report `cuda:0` for them, so
  hetrain's checks (`t.device.type == "cuda"`, comm/p2p.py's guard before gloo) treat
  them exactly as CUDA tensors, while every kernel (and gloo, which sees the real C++
  device) runs on the host bytes. Factories with `device="cuda"`, `.to("cuda")`,
  `.cuda()` and every op with a device input produce device tensors; `.cpu()` copies out.
  `pin_memory=True` gives "pinned" host tensors (`is_pinned()` is true).
- **`torch.cuda`**: `Stream`, `Event` (record / wait / query / synchronize),
  `current_stream`, the `stream()` context, `wait_stream`, `Tensor.record_stream`,
  `synchronize`, `mem_get_info`, device count / set_device / current_device,
  `set_sync_debug_mode` ("error": a host sync on a device tensor raises),
  `cudart().cudaHostRegister` (the registered host memory counts as pinned). Threads
  started after `install()` run under the checker too.
- **NCCL**: `new_group(backend="nccl")` makes a gloo group that behaves like an NCCL one:
  it refuses host tensors (as an NCCL-only group does) and runs each collective on its own
  stream, which waits for the caller's stream at launch; `work.wait()` makes the caller's
  current stream wait for it (the host only with TORCH_NCCL_BLOCKING_WAIT=1), and
  `is_completed()` reports completion only on the second query. `nccl_log()` lists the
  collectives issued, in order, so a test can check that ranks issue them in one order.

**The race checker** is modelled on PyTorch's CUDA sanitizer (`torch/cuda/_sanitizer.py`):
a TorchDispatchMode sees every op, reads each tensor argument as read or written from the
op's schema, and tags the access with the stream it was issued on (the current stream for
ops on device tensors; "the host" for CPU ops on pinned memory, including gloo reading or
writing a pinned buffer). Streams carry vector clocks: `Event.record` snapshots one,
`wait_event` / `wait_stream` merge one, an op issued by the host is ordered after
everything the host did before, and the host learns a stream's progress only through
`synchronize()`, a successful `query()` or a blocking copy. An access to bytes that an
access on another stream wrote (or, for a write, read) with no such ordering between them
is a race: `CudaRaceError` names both accesses (op, stream, the caller's file:line).
Asynchronous work is executed at once (the stand-in has no real concurrency), so a race
is found from the ordering alone, whatever the timing.

Processes started by a test install it at start: put `tests/cudastandin` first on
PYTHONPATH (its `sitecustomize.py` runs at interpreter start) and set
HETRAIN_TEST_CUDA_STANDIN=<gpus>; a race there ends the process with the report.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist

try:  # imported as tests.cudastandin.standin (pytest) or as standin (sitecustomize.py)
    from .racecheck import Checker, CudaRaceError, RaceMode, _caller, _tensors, _Timeline  # noqa: F401
except ImportError:
    from racecheck import Checker, CudaRaceError, RaceMode, _caller, _tensors, _Timeline  # noqa: F401

ENV = "HETRAIN_TEST_CUDA_STANDIN"
_REAL_DEVICE = torch._C.TensorBase.device.__get__
_CPU = torch.device("cpu")


_CHECKER: Checker | None = None


def checker() -> Checker:
    if _CHECKER is None:
        raise RuntimeError("the CUDA stand-in is not installed")
    return _CHECKER


# ---- torch.cuda surface -----------------------------------------------------------------
class Stream(_Timeline):
    """A CUDA stream of the stand-in (non-blocking: no implicit sync with the default one)."""

    _count = 0

    def __init__(self, device=None, priority: int = 0, name: str | None = None, **_):
        Stream._count += 1
        super().__init__(name or f"stream {Stream._count}")
        self.device = torch.device("cuda", _index(device))
        self.cuda_stream = Stream._count
        _STREAMS.add(self)

    def _issue(self) -> None:
        """An operation issued by the host on this stream is ordered after the host's past."""
        self.join(_CHECKER.host.clock)

    def wait_event(self, event: "Event") -> None:
        with _CHECKER.lock:
            self._issue()
            if event.clock is not None:
                self.join(event.clock)

    def wait_stream(self, stream: "Stream") -> None:
        with _CHECKER.lock:
            self._issue()
            self.join(stream.clock)

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        _CHECKER.host.join(self.clock)
        return True

    def synchronize(self) -> None:
        _CHECKER.host_sync(dict(self.clock), f"synchronize {self.name}")

    def __repr__(self) -> str:
        return f"<stand-in {self.name} on {self.device}>"


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.clock: dict[int, int] | None = None
        self.queries = 0
        self.timing = enable_timing
        self.at: float | None = None  # host seconds at record: the stand-in runs the work already queued at once
        self.known = False  # the host has learnt it completed (a successful query, or synchronize)

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        with _CHECKER.lock:
            stream._issue()
            self.clock = dict(stream.clock)
        self.queries = 0
        self.at, self.known = time.perf_counter(), False

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def query(self) -> bool:
        """False on the first query after each record (the work is "still running"), so
        polling code takes its not-ready path; True afterwards, and the host then knows."""
        self.queries += 1
        if self.clock is not None and self.queries < 2:
            return False
        if self.clock is not None:
            with _CHECKER.lock:
                _CHECKER.host.join(self.clock)
        self.known = True
        return True

    def synchronize(self) -> None:
        if self.clock is not None:
            with _CHECKER.lock:
                _CHECKER.host.join(self.clock)
        self.known = True

    def elapsed_time(self, end: "Event") -> float:
        """Milliseconds between the two records (host time: the stand-in runs work when it
        is queued). As CUDA: both events need enable_timing=True and a record, and `end`
        must have completed, which the host learns only from `query()` or `synchronize()`
        (on a real GPU reading it earlier fails with cudaErrorNotReady)."""
        if not (self.timing and end.timing):
            raise RuntimeError("CUDA error: invalid resource handle (elapsed_time needs events made with "
                               "enable_timing=True)")
        if self.at is None or end.at is None:
            raise RuntimeError("CUDA error: invalid resource handle (elapsed_time of an event never recorded)")
        if not end.known:
            raise RuntimeError("CUDA error: device not ready (elapsed_time before the end event completed: "
                               "query() or synchronize() it first)")
        return (end.at - self.at) * 1e3


_STREAMS: "weakref.WeakSet[Stream]" = weakref.WeakSet()
_DEFAULT: dict[int, Stream] = {}
_LOCAL = threading.local()


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else current_device()


def current_device() -> int:
    return getattr(_LOCAL, "device", 0)


def set_device(device) -> None:
    i = _index(device)
    if not 0 <= i < _COUNT[0]:
        raise RuntimeError(f"CUDA error: invalid device ordinal {i} (the stand-in has {_COUNT[0]})")
    _LOCAL.device = i


def default_stream(device=None) -> Stream:
    i = _index(device)
    if i not in _DEFAULT:
        _DEFAULT[i] = Stream(i, name=f"default stream of cuda:{i}")
    return _DEFAULT[i]


def current_stream(device=None) -> Stream:
    cur = getattr(_LOCAL, "streams", {})
    i = _index(device)
    return cur.get(i) or default_stream(i)


@contextmanager
def stream(s: Stream | None):
    if s is None:
        yield
        return
    cur = _LOCAL.__dict__.setdefault("streams", {})
    i = s.device.index
    before = cur.get(i)
    cur[i] = s
    try:
        yield
    finally:
        if before is None:
            cur.pop(i, None)
        else:
            cur[i] = before


def synchronize(device=None) -> None:
    clock: dict[int, int] = {}
    for s in list(_STREAMS):
        for k, v in s.clock.items():
            clock[k] = max(clock.get(k, 0), v)
    _CHECKER.host_sync(clock, "torch.cuda.synchronize")


_COUNT = [1]
_MEM = [16 * 2**30, 16 * 2**30]


def mem_get_info(device=None) -> tuple[int, int]:
    return _MEM[0], _MEM[1]


def set_sync_debug_mode(mode) -> None:
    _CHECKER.sync_debug = {0: "default", 1: "warn", 2: "error"}.get(mode, mode)


def get_sync_debug_mode() -> int:
    return {"default": 0, "warn": 1, "error": 2}[_CHECKER.sync_debug]


# ---- NCCL: gloo groups that take device tensors only, on a stream of their own -----------
class Work:
    """The work of a stand-in NCCL collective: gloo's, plus the event its stream recorded."""

    def __init__(self, work, event: Event):
        self.work = work
        self.event = event

    def wait(self, timeout=None) -> bool:
        self.work.wait()  # the bytes (gloo moves them on the host)
        current_stream().wait_event(self.event)  # NCCL: a stream wait; the host learns nothing
        if os.environ.get("TORCH_NCCL_BLOCKING_WAIT") == "1":
            self.event.synchronize()
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed() and self.event.query()


_NCCL: dict[int, tuple[object, Stream, str]] = {}
_ISSUED: list[str] = []  # every NCCL collective this process issued, in order: "group op elements"
_NCCL_DEVICES: list = []  # the device_id each NCCL group was made with (None: none given)


def nccl_devices() -> list:
    """The `device_id` of every NCCL group this process made, in order."""
    return list(_NCCL_DEVICES)


def nccl_log() -> list[str]:
    """The NCCL collectives this process issued, in issue order (group, op, elements). The
    ranks of one communicator set must issue them in one global order: with one hardware
    queue (CUDA_DEVICE_MAX_CONNECTIONS=1) an interleaving that differs between ranks can
    deadlock, although the stand-in's gloo groups progress independently and would not."""
    return list(_ISSUED)


def _new_group(real):
    def new_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if str(backend).lower() != "nccl":
            return real(*args, **kwargs)
        kwargs["backend"] = "gloo"
        _NCCL_DEVICES.append(kwargs.pop("device_id", None))  # gloo takes no CUDA device
        g = real(*args, **kwargs)
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            label = f"nccl{len(_NCCL)}"
            _NCCL[id(g)] = (g, Stream(current_device(), name=f"NCCL stream of group {label}"), label)
        return g
    return new_group


def _collective(real, name: str):
    def call(tensor, *args, group=None, async_op: bool = False, **kwargs):
        if group is None or id(group) not in _NCCL:
            return real(tensor, *args, group=group, async_op=async_op, **kwargs)
        ts = _tensors(tensor)
        if any(_CHECKER.kind(t) != "device" for t in ts):
            raise RuntimeError(f"{name}: No backend type associated with device type cpu (the group is an NCCL "
                               "group of the CUDA stand-in: it takes CUDA tensors only)")
        _, s, label = _NCCL[id(group)]
        _ISSUED.append(f"{label} {name} {sum(t.numel() for t in ts)}")
        s.wait_stream(current_stream())  # NCCL orders its stream after the caller's at launch
        what = f"{name} on NCCL group {label} at {_caller()}"
        for t in ts:
            _CHECKER.access(t, True, s, what)
        _MODE.quiet.on = True
        try:
            w = real(tensor, *args, group=group, async_op=True, **kwargs)
        finally:
            _MODE.quiet.on = False
        work = Work(w, s.record_event())
        if async_op:
            return work
        work.wait()
        return None
    return call


_FUTURE_INIT = torch.futures.Future.__init__


def _future_init(self, *, devices=None):
    """Futures take `devices=` (CUDA futures record events on them; the stand-in's values
    are ready when set, and DDP's reducer waits on them in C++, out of the checker's view)."""
    _FUTURE_INIT(self)


# ---- install ------------------------------------------------------------------------------
_MODE: RaceMode | None = None
_PATCHES: list = []
_MISSING = object()


def _patch(obj, name: str, value) -> None:
    old = obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name, _MISSING)
    _PATCHES.append((obj, name, old))
    setattr(obj, name, value)


def _tensor_device(self):
    d = _REAL_DEVICE(self)
    if d.type == "cpu" and _CHECKER is not None:
        i = _CHECKER.index(self)
        if i >= 0:
            return torch.device("cuda", i)
    return d


_REAL_TO = torch.Tensor.to


def _to(self, *args, **kwargs):
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    cur = _tensor_device(self)
    if device is not None and (device.type == "cuda" or cur.type == "cuda"):
        if device.type == "cuda":
            device = torch.device("cuda", _index(device))
        if cur == device and (dtype is None or dtype == self.dtype) and not kwargs.get("copy"):
            return self
        return torch.ops.aten._to_copy.default(self, dtype=dtype or self.dtype, device=device,
                                               non_blocking=bool(non_blocking))
    return _REAL_TO(self, *args, **kwargs)


def _host_register(ptr: int, size: int, flags: int = 0) -> int:
    """cudaHostRegister: from now on the host memory at `ptr` is "pinned" (its accesses
    are tracked, as those of `pin_memory=True` tensors); returns cudaSuccess (0)."""
    with _CHECKER.lock:
        _CHECKER.pinned.add(ptr)
    return 0


def _host_unregister(ptr: int) -> int:
    with _CHECKER.lock:
        _CHECKER.pinned.discard(ptr)
        _CHECKER.accesses.pop(ptr, None)
    return 0


def _checked_run(run):
    """Thread.run under a race-checking mode of the thread's own (dispatch modes are per
    thread), so a thread started after install() (a transport's worker thread) is checked
    and makes device tensors as the main thread does."""

    def checked(self):
        if _CHECKER is None:
            return run(self)
        with RaceMode(_CHECKER, sys.modules[__name__]):
            return run(self)

    return checked


_CUDART = SimpleNamespace(cudaHostRegister=_host_register, cudaHostUnregister=_host_unregister)


def _device_properties(device=None):
    return SimpleNamespace(name="CUDA stand-in", total_memory=_MEM[1], multi_processor_count=132, major=9, minor=0)


@contextmanager
def _device_ctx(device):
    before = current_device()
    if device is not None and _index(device) >= 0:
        set_device(device)
    try:
        yield
    finally:
        _LOCAL.device = before


def install(count: int = 1, free: int | None = None, total: int | None = None) -> Checker:
    """Make this process look like it has `count` GPUs; returns the race checker."""
    global _CHECKER, _MODE
    if _CHECKER is not None:
        return _CHECKER
    _COUNT[0] = count
    _MEM[1] = total or _MEM[1]
    _MEM[0] = min(free or _MEM[1], _MEM[1])
    _CHECKER = Checker()
    cuda = torch.cuda
    for name, value in {
        "is_available": lambda: True, "device_count": lambda: _COUNT[0], "current_device": current_device,
        "set_device": set_device, "Stream": Stream, "Event": Event, "current_stream": current_stream,
        "default_stream": default_stream, "stream": stream, "synchronize": synchronize,
        "mem_get_info": mem_get_info, "get_device_name": lambda device=None: "CUDA stand-in",
        "get_device_properties": _device_properties, "set_sync_debug_mode": set_sync_debug_mode,
        "get_sync_debug_mode": get_sync_debug_mode, "_lazy_init": lambda: None, "is_initialized": lambda: True,
        "init": lambda: None, "empty_cache": lambda: None, "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0, "reset_peak_memory_stats": lambda device=None: None,
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None, "device": _device_ctx,
        "is_bf16_supported": lambda *a, **k: False, "cudart": lambda: _CUDART,
    }.items():
        _patch(cuda, name, value)
    T = torch.Tensor
    _patch(T, "device", property(_tensor_device))
    _patch(T, "is_cuda", property(lambda self: _tensor_device(self).type == "cuda"))
    _patch(T, "get_device", lambda self: _CHECKER.index(self))
    _patch(T, "to", _to)
    _patch(T, "cuda", lambda self, device=None, non_blocking=False, **k:
           _to(self, torch.device("cuda", _index(device)), non_blocking=non_blocking))
    _patch(T, "cpu", lambda self, **k: _to(self, _CPU))
    _patch(T, "record_stream", lambda self, stream: None)  # an allocator hint: nothing to check
    _patch(T, "pin_memory", lambda self, *a: torch.ops.aten._to_copy.default(self, pin_memory=True))
    _patch(torch.futures.Future, "__init__", _future_init)
    _patch(dist, "is_nccl_available", lambda: True)
    _patch(dist, "new_group", _new_group(dist.new_group))
    for name in ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter_tensor"):
        _patch(dist, name, _collective(getattr(dist, name), name))
    _patch(threading.Thread, "run", _checked_run(threading.Thread.run))
    _MODE = RaceMode(_CHECKER, sys.modules[__name__])
    _MODE.__enter__()
    return _CHECKER


def uninstall() -> list[str]:
    """Undo install(); returns the races seen."""
    global _CHECKER, _MODE
    if _CHECKER is None:
        return []
    _MODE.__exit__(None, None, None)
    for obj, name, old in reversed(_PATCHES):
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)
    _PATCHES.clear()
    races, _CHECKER, _MODE = _CHECKER.races, None, None
    _NCCL.clear()
    _DEFAULT.clear()
    _LOCAL.__dict__.clear()
    return races


def install_from_environ() -> None:
    """Called at interpreter start (sitecustomize.py) where HETRAIN_TEST_CUDA_STANDIN is set:
    `<gpus>` or `<gpus>,<free bytes>,<total bytes>`."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = [int(x) for x in spec.split(",")]
    install(*parts)
