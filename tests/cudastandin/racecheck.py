"""The race checker of the CUDA stand-in (standin.py), modelled on PyTorch's CUDA
sanitizer (`torch/cuda/_sanitizer.py`): streams and the host are timelines with vector
clocks; a TorchDispatchMode reads each op's tensor arguments as read or written from its
schema and records the access, with its byte range, on the stream it was issued on; an
access to bytes that an access on another timeline wrote (or, for a write, read) with no
event, `wait_stream` or host synchronisation between them raises `CudaRaceError`, naming
both accesses (op, stream, the caller's file:line)."""
from __future__ import annotations

import os
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


# ---- the dispatch mode: who touches which bytes, on which stream -------------------------
_NO_DATA = {"empty_like", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like", "new_zeros",
            "new_ones", "new_full", "record_stream", "is_pinned", "sym_size", "sym_stride", "sym_numel",
            "sym_storage_offset", "_has_compatible_shallow_copy_type", "set_"}
_HOST_SYNC = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "_assert_async"}


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


class RaceMode(TorchDispatchMode):
    def __init__(self, chk: Checker, cuda):
        super().__init__()
        self.chk = chk
        self.cuda = cuda  # the stand-in's torch.cuda surface (standin.py)
        self.quiet = threading.local()  # inside a stand-in collective: it records its own accesses

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = func._schema.name.split("::")[-1]
        chk = self.chk
        if name == "is_pinned":
            return chk.kind(args[0]) == "pinned"
        want_device = None
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type == "cuda":
            want_device = torch.device("cuda", self.cuda._index(kwargs["device"]))
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
        where = self.cuda.current_stream() if on_device else chk.host
        what = None
        if not view and name not in _NO_DATA and ("device" in kinds or "pinned" in kinds):
            what = f"{func._schema.name} at {_caller()}"
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
                (chk.index(t) for t, k in zip(inputs, kinds) if k == "device"), self.cuda.current_device())
            known = {chk.key(t) for t in inputs}
            for t in _tensors(out):
                if chk.key(t) not in known:
                    chk.adopt(t, target, index)
                    if target != "plain":
                        what = what or f"{func._schema.name} at {_caller()}"
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
