"""The host group's CUDA strategy: segments registered as pinned host memory, so a CUDA
bucket goes from the GPU straight into this process's segment and the sums come back
straight from every member's segment, with no pinned staging buffer and no second copy.

Per round (group.py says what the rounds are):
- copy in: a device-to-host copy on this group's copy stream into the segment, after an
  event the caller's stream recorded when the bucket was handed over (`start`), and the
  host waits for the copy's event before it publishes WRITTEN;
- reduce-scatter: on the host, as for host tensors (the segments are host memory), into
  an fp32 host accumulator, then into slice i of this process's segment;
- all-gather: host-to-device copies of every slice, from the members' segments, on the
  copy stream; the host waits for their event before it publishes DONE (after DONE the
  members may overwrite their segments).

Registration is `cudaHostRegister` on this process's mappings (its own segment and its
peers'): page-locked memory the copy engines read and write directly.
"""
from __future__ import annotations

import warnings

import torch

from ...errors import UserError
from .group import HostGroup, ShmWork


def _register(t: torch.Tensor) -> bool:
    """Page-lock `t`'s memory for the copy engines; False where CUDA refuses (a locked-memory
    limit, `ulimit -l`): the copies then still work, from pageable memory, only slower."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except (RuntimeError, AttributeError) as exc:
        err = exc
    if not isinstance(err, BaseException) and int(err) == 0:
        return True
    warnings.warn(f"cudaHostRegister of a {t.numel() >> 20} MiB shared-memory segment failed ({err}); its copies "
                  "to and from the GPU go unpinned (slower). Raise the locked-memory limit (ulimit -l) to pin it",
                  RuntimeWarning, stacklevel=2)
    return False


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class CudaHostGroup(HostGroup):
    """A host group whose members' segments are pinned in this process; all-reduces CUDA
    tensors (on `device`) as well as host ones."""

    def __init__(self, device: torch.device, **kw):
        super().__init__(**kw)
        self.device = device
        self.copy = torch.cuda.Stream(device)
        self._pinned: list[torch.Tensor] = []
        for s in self.segments:
            if _register(s.data):
                self._pinned.append(s.data)
        self._out: torch.Tensor | None = None  # host accumulator of this member's slice

    def start(self, t: torch.Tensor, average: bool = False, what: str = "all-reducing") -> ShmWork:
        """As `HostGroup.start`; for a CUDA tensor, its copy waits for what the caller's
        stream has issued so far (the bucket's producers)."""
        if t.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(t.device))
            return super().start(_Marked(t, ev), average, what)
        return super().start(t, average, what)

    def all_reduce(self, t, average: bool = False, what: str = "all-reducing"):
        ready = None
        if isinstance(t, _Marked):
            t, ready = t.tensor, t.event
        if t.device.type != "cuda":
            return super().all_reduce(t, average, what)
        if ready is None:  # called on the caller's thread: after what its stream issued
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(t.device))
        if not t.is_contiguous():
            raise UserError(f"a shared-memory all-reduce takes a contiguous tensor, got one on {t.device} that is not")
        flat = t.view(-1)
        cap = self.capacity // flat.element_size()
        with torch.cuda.device(t.device), torch.cuda.stream(self.copy):
            self.copy.wait_event(ready)
            for lo in range(0, flat.numel(), cap):
                self._round(flat[lo:lo + cap], average, what)
        return t

    def _sync(self) -> None:
        ev = torch.cuda.Event()
        ev.record(self.copy)
        ev.synchronize()

    def _copy_in(self, x: torch.Tensor, mine: torch.Tensor, lo: int = 0, hi: int = 0) -> None:
        if x.device.type != "cuda":
            return super()._copy_in(x, mine, lo, hi)
        mine.copy_(x, non_blocking=True)  # all of it: this member sums its slice on the host
        self._sync()  # in the segment before WRITTEN says so

    def _reduce_slice(self, x: torch.Tensor, views: list[torch.Tensor], lo: int, hi: int, average: bool) -> None:
        if x.device.type != "cuda":
            return super()._reduce_slice(x, views, lo, hi, average)
        out = self._acc(hi - lo, x.dtype)
        self._reduce(out, [v[lo:hi] for v in views], average)
        views[self.index][lo:hi].copy_(out)

    def _acc(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        if self._out is None or self._out.numel() < n * dtype.itemsize:
            self._out = torch.empty(n * dtype.itemsize, dtype=torch.uint8)
        return self._out[:n * dtype.itemsize].view(dtype)

    def _gather(self, x: torch.Tensor, views: list[torch.Tensor], b: list[int], s: int) -> None:
        if x.device.type != "cuda":
            return super()._gather(x, views, b, s)
        for j in range(self.size):  # this member's slice too: x holds the gradient, not the sum
            if b[j + 1] > b[j]:
                x[b[j]:b[j + 1]].copy_(views[j][b[j]:b[j + 1]], non_blocking=True)
        self._sync()  # out of every segment before DONE lets the members overwrite them

    def close(self) -> None:
        for t in self._pinned:
            try:
                _unregister(t)
            except RuntimeError:
                pass
        self._pinned = []
        super().close()


class _Marked:
    """A CUDA tensor and the event after which its bytes are final (handed to the thread)."""

    def __init__(self, tensor: torch.Tensor, event):
        self.tensor = tensor
        self.event = event
