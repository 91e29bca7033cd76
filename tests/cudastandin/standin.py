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
  `set_sync_debug_mode` ("error": a host sync on a device tensor raises).
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
import weakref
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

ENV = "HETRAIN_TEST_CUDA_STANDIN"
_REAL_DEVICE = torch._C.TensorBase.device.__get__
_CPU = torch.device("cpu")


class CudaRaceError(AssertionError):
    """Two accesses to the same bytes on different streams with no ordering between them.
    An AssertionError (not a RuntimeError), so code that turns CUDA RuntimeErrors into its
    own errors cannot swallow it."""


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module."""
    f = sys._getframe(2)
    here = os.path.dirname(__file__)
    torch_dir = os.path.dirname(torch.__file__)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(torch_dir) and not fn.startswith(here) and "contextlib" not in fn:
            return f"{os.path.relpath(fn) if not fn.startswith('<') else fn}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


class _Timeline:
    """A stream (or the host): its vector clock."""

    def __init__(self, name: str):
        self.name = name
        self.clock: dict[int, int] = {id(self): 0}

    def tick(self) -> int:
        self.clock[id(self)] += 1
        return self.clock[id(self)]

    def join(self, other: dict[int, int]) -> None:
        for k, v in other.items():
            if self.clock.get(k, 0) < v:
                self.clock[k] = v


class Checker:
    """Tracks device / pinned storages and their accesses; finds unordered ones."""

    def __init__(self):
        self.lock = threading.RLock()
        self.host = _Timeline("host")
        self.device: dict[int, int] = {}  # storage data pointer -> index of the GPU it is "on"
        self.pinned: set[int] = set()
        self.accesses: dict[int, list] = {}  # storage -> [(lo, hi, write, timeline, seq, what)]
        self.races: list[str] = []
        self.raise_on_race = True
        self.sync_debug = "default"

    # ---- storages -------------------------------------------------------------------------
    @staticmethod
    def key(t: torch.Tensor) -> int:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return 0

    def kind(self, t: torch.Tensor) -> str:
        k = self.key(t)
        if not k:
            return "plain"
        return "device" if k in self.device else "pinned" if k in self.pinned else "plain"

    def index(self, t: torch.Tensor) -> int:
        return self.device.get(self.key(t), -1)

    def adopt(self, t: torch.Tensor, kind: str, index: int = 0) -> None:
        """A new storage: register it as device / pinned / plain (forgetting any storage
        that lived at that address before), and forget it when it is freed."""
        k = self.key(t)
        if not k:
            return
        with self.lock:
            self.accesses.pop(k, None)
            self.device.pop(k, None)
            self.pinned.discard(k)
            if kind == "plain":
                return
            if kind == "device":
                self.device[k] = index
            else:
                self.pinned.add(k)
        weakref.finalize(t.untyped_storage(), self._freed, k)

    def _freed(self, k: int) -> None:
        with self.lock:
            self.device.pop(k, None)
            self.pinned.discard(k)
            self.accesses.pop(k, None)

    # ---- accesses -------------------------------------------------------------------------
    def access(self, t: torch.Tensor, write: bool, where: _Timeline, what: str) -> None:
        k = self.key(t)
        if not k or (k not in self.device and k not in self.pinned) or t.numel() == 0:
            return
        size = t.element_size()
        extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        lo = t.storage_offset() * size
        hi = lo + extent * size
        with self.lock:
            seq = where.tick()
            recs = self.accesses.setdefault(k, [])
            keep = []
            for r in recs:
                rlo, rhi, rw, rtl, rseq, rwhat = r
                overlap = rlo < hi and lo < rhi
                if overlap and rtl is not where and (rw or write) and where.clock.get(id(rtl), 0) < rseq:
                    self._race(k, (rw, rtl, rwhat), (write, where, what))
                if write and overlap and lo <= rlo and rhi <= hi:
                    continue  # superseded by this write (checked above)
                keep.append(r)
            keep.append((lo, hi, write, where, seq, what))
            self.accesses[k] = keep[-256:]

    def _race(self, k, first, second) -> None:
        def say(a):
            return f"{'write' if a[0] else 'read'} on {a[1].name} by {a[2]}"

        msg = (f"CUDA stream race on {'device' if k in self.device else 'pinned host'} memory: {say(second)} is not "
               f"ordered after the {say(first)} (no event, wait_stream or host synchronisation between them)")
        self.races.append(msg)
        if self.raise_on_race:
            raise CudaRaceError(msg)

    def host_sync(self, clock: dict[int, int], why: str) -> None:
        if self.sync_debug == "error":
            raise RuntimeError(f"called a synchronizing CUDA operation ({why}) under set_sync_debug_mode('error')")
        with self.lock:
            self.host.join(clock)


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

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        with _CHECKER.lock:
            stream._issue()
            self.clock = dict(stream.clock)
        self.queries = 0

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
        return True

    def synchronize(self) -> None:
        if self.clock is not None:
            with _CHECKER.lock:
                _CHECKER.host.join(self.clock)

    def elapsed_time(self, end: "Event") -> float:
        return 0.0


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


# ---- the dispatch mode: who touches which bytes, on which stream -------------------------
_NO_DATA = {"empty_like", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like", "new_zeros",
            "new_ones", "new_full", "record_stream", "is_pinned", "sym_size", "sym_stride", "sym_numel",
            "sym_storage_offset", "_has_compatible_shallow_copy_type", "set_"}
_HOST_SYNC = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "_assert_async"}


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


class RaceMode(TorchDispatchMode):
    def __init__(self, chk: Checker):
        super().__init__()
        self.chk = chk
        self.quiet = threading.local()  # inside a stand-in collective: it records its own accesses

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func._schema.name.split("::")[-1]
        chk = self.chk
        if name == "is_pinned":
            return chk.kind(args[0]) == "pinned"
        want_device = None
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "cuda":
            want_device = torch.device("cuda", _index(kwargs["device"]))
            kwargs["device"] = _CPU
        want_pinned = bool(kwargs.get("pin_memory"))
        if want_pinned:
            kwargs["pin_memory"] = None if name == "_to_copy" else False
        if getattr(self.quiet, "on", False):
            return func(*args, **kwargs)
        # which tensor arguments are read, which written (the op's schema, as the sanitizer reads it)
        reads, writes = [], []
        schema_args = func._schema.arguments
        for i, a in enumerate(schema_args):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            ts = _tensors(v)
            if not ts:
                continue
            w = (a.alias_info is not None and a.alias_info.is_write) or func._schema.name.startswith("c10d::")
            (writes if w else reads).extend(ts)
        inputs = reads + writes
        kinds = [chk.kind(t) for t in inputs]
        on_device = want_device is not None or "device" in kinds
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        where = current_stream() if on_device else chk.host
        what = f"{func._schema.name} at {_caller()}"
        if not view and name not in _NO_DATA and ("device" in kinds or "pinned" in kinds):
            if on_device:
                where._issue()
            for t in reads:
                chk.access(t, False, where, what)
            for t in writes:
                chk.access(t, True, where, what)
        out = func(*args, **kwargs)
        # new storages: where they live
        if not view and not (writes and name.endswith("_")):
            if name == "_to_copy":
                target = ("device" if want_device else "pinned" if want_pinned else
                          "plain" if kwargs.get("device") is not None else
                          "device" if kinds[0] == "device" else "plain")
            else:
                target = "device" if on_device or (not inputs and _ddp_device()) else (
                    "pinned" if want_pinned else "plain")
            index = want_device.index if want_device else next(
                (chk.index(t) for t, k in zip(inputs, kinds) if k == "device"), current_device())
            known = {chk.key(t) for t in inputs}
            for t in _tensors(out):
                if chk.key(t) not in known:
                    chk.adopt(t, target, index)
                    if target != "plain":
                        chk.access(t, True, where, what)
        # operations that make the host wait for the stream
        if on_device:
            blocking = name in _HOST_SYNC or (name in ("copy_", "_to_copy") and not kwargs.get("non_blocking")
                                              and not (len(args) > 2 and args[2]))
            host_side = name in _HOST_SYNC or any(k != "device" for k in kinds) or (
                name == "_to_copy" and want_device is None and kwargs.get("device") is not None)
            if blocking and host_side:
                chk.host_sync(dict(where.clock), f"{func._schema.name} (a blocking copy or read to the host)")
        return out



def _ddp_device() -> bool:
    """A buffer DDP's C++ reducer allocates (its gradient buckets, from the options of a
    parameter whose real device is the CPU): on the GPU when DDP's module is. Without this
    the stand-in's DDP would hand the comm hook host buckets."""
    f = sys._getframe(2)
    for _ in range(12):
        if f is None:
            return False
        if f.f_code.co_filename.endswith(os.path.join("nn", "parallel", "distributed.py")):
            return getattr(f.f_locals.get("self"), "device_type", None) == "cuda"
        f = f.f_back
    return False


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
        "is_bf16_supported": lambda *a, **k: False,
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
    _MODE = RaceMode(_CHECKER)
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
