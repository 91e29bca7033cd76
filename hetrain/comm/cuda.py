"""CUDA tensors on the data plane: the engine's only CUDA-specific module.

Three stagings (see comm/staging/ for the calls they share; the two work stagings
build on its `WorkStaging`: work buffer views, the pre-scaled fill, the host wire):

- `CudaDirect`: a GPU worker pushing to summation servers over gloo. Each gradient's
  hook records an event on the compute stream; a device-to-host copy stream waits on it
  and copies the gradient into a pinned host buffer (with a codec: gathers it on the GPU,
  encodes it there, error-feedback residual on the GPU too, and copies only the payload).
  An event recorded on the copy stream when a partition is complete tells the engine
  (by polling, never blocking backward) that it can be sent. Results come back into the
  same pinned buffer and go up on a host-to-device stream; the compute stream waits on it
  (a stream wait, no host sync) before the optimizer runs.
- `CudaWorkHost`: collectives over gloo on CUDA tensors (workers sharing one GPU, or
  --collective gloo): the pre-scaled gradients are copied into a pinned work buffer the
  same way, collectives run there, and results go back on the host-to-device stream.
- `CudaWorkDevice`: collectives over NCCL: the work buffer stays on the GPU (filled on
  the compute stream, which NCCL orders itself after); only the partitions this worker
  pushes to the servers (hierarchical path) are copied out and back.

Pinned buffers are allocated once per layout. gloo's send/recv take host memory only;
every gloo call goes through comm/p2p.py's guard, so a device pointer never reaches it.
"""
from __future__ import annotations

import functools
from collections import deque

import torch

from .compress import ErrorFeedback
from .flatlayout import FlatLayout
from .staging import Staging, WorkStaging
from .wire import decode_part, encode_part, payload_bytes


class DeviceLostError(RuntimeError):
    """A CUDA call failed: the GPU of this worker is gone or broken. Names the rank."""


_CUDA_ERRORS = (getattr(torch, "AcceleratorError", RuntimeError),)


def _on_device(what: str):
    """A staging call that touches the GPU: a CUDA failure becomes a DeviceLostError that
    names this rank and its GPU (the others then lose this rank, as for any dead peer)."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except DeviceLostError:
                raise
            except _CUDA_ERRORS as err:
                raise self.cuda.lost(what, err) from None
        return call
    return wrap


class Cuda:
    """Streams, events and buffers of one GPU, and CUDA failures turned into a message
    that names the rank and its device."""

    def __init__(self, device: torch.device, describe: str = "this worker"):
        self.device = device
        self.describe = describe
        try:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
        except RuntimeError as err:
            raise self.lost("creating its copy streams", err) from None

    def lost(self, what: str, err: BaseException) -> DeviceLostError:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return DeviceLostError(f"{self.describe}: its GPU {self.device} failed while {what}: {first}. The job cannot "
                               "continue on this GPU; check it (nvidia-smi) and restart from the last checkpoint")

    def pinned(self, n: int, dtype=torch.float32) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=True)

    def empty(self, n: int, dtype=torch.float32) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.device)

    def compute(self):
        return torch.cuda.current_stream(self.device)

    def mark(self) -> torch.cuda.Event:
        """An event on the compute stream: the gradient handed over now is final there."""
        ev = torch.cuda.Event()
        ev.record(self.compute())
        return ev

    def record(self, stream) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def done(self, ev: torch.cuda.Event, wait: bool, what: str) -> bool:
        """Whether the work before `ev` finished; with `wait`, block until it has (only ever
        called outside backward: hooks poll)."""
        try:
            if wait:
                ev.synchronize()
                return True
            if not ev.query():
                return False
            # The host has seen the work finish, so what follows is ordered after it. A
            # successful query() says so to CUDA but not to PyTorch's CUDA sanitizer, which
            # only hears of synchronize(): on a finished event that returns at once and lets
            # `--cuda-sanitizer` runs see the ordering the host relies on.
            ev.synchronize()
            return True
        except RuntimeError as err:
            raise self.lost(what, err) from None


def _pinned_views(st, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A partition's pinned host bytes (fp32 `host`, or the encoded `payload`), sent and
    received in place: the sum arrives after the server has our push, so after the send
    read it."""
    if st.layout.wire is None:
        p = st.layout.parts[pid]
        v = st.host[p.start: p.start + p.length]
    else:
        w = st.layout.wire[pid]
        v = st.payload[w.offset: w.offset + w.nbytes]
    return v, v


class _CudaStaging(Staging):
    """Shared: the user's tensors as flat device views, copy-out events polled in order."""

    polled = True  # a partition's copy completes on its stream after `fill` returned

    def __init__(self, layout: FlatLayout, cuda: Cuda):
        super().__init__(layout)
        self.cuda = cuda

    def begin(self, scale: float = 1.0) -> None:
        super().begin(scale)
        self.src: dict[int, torch.Tensor] = {}  # tensor -> flat view of it (or a contiguous copy)
        self.copies: dict[int, torch.Tensor] = {}  # tensors without a usable flat view -> their copy
        self.users: dict[int, torch.Tensor] = {}
        self.storages: set = set()
        self.pending: deque = deque()  # (pid, event): copies still running, in stream order

    def _source(self, i: int, t: torch.Tensor, lo: int, hi: int, stream) -> torch.Tensor:
        """Elements [lo, hi) of tensor i as a flat device tensor, read on `stream`. A tensor
        that is not contiguous, or shares storage with an earlier one (its result could
        land before the other is read), goes through a copy written back in complete()."""
        td = t.detach()
        if i not in self.src:
            storage = td.untyped_storage().data_ptr() if td.numel() else None
            if td.is_contiguous() and (storage is None or storage not in self.storages):
                self.src[i] = td.view(-1)
            else:
                self.src[i] = self.copies[i] = torch.empty(td.numel(), dtype=td.dtype, device=td.device)
                self.copies[i].record_stream(self.cuda.h2d)
            self.storages.add(storage)
            self.users[i] = td
            td.record_stream(self.cuda.d2h)
            td.record_stream(self.cuda.h2d)
        if i in self.copies:
            self.copies[i][lo:hi].copy_(td.reshape(-1)[lo:hi])
        return self.src[i][lo:hi]

    def _poll(self, wait: bool, what: str) -> list[int]:
        out = []
        while self.pending:
            pid, ev = self.pending[0]
            if not self.cuda.done(ev, wait and not out, what):
                break
            out.append(pid)
            self.pending.popleft()
        return out

    def _write_back(self) -> None:
        for i, flat in self.copies.items():
            t = self.users[i]
            t.copy_(flat.view_as(t))

    def complete(self, tensors) -> None:
        try:
            with torch.cuda.stream(self.cuda.h2d):
                self._write_back()
            self.cuda.compute().wait_stream(self.cuda.h2d)  # a stream wait: the host goes on
        except RuntimeError as err:
            raise self.cuda.lost("copying results back to the GPU", err) from None


class _CopiedOut(_CudaStaging):
    """Stagings whose `stage_out` copies a partition's wire bytes off the GPU on the copy
    stream: `out_ready` polls those copies, in order, and `outstanding` counts them."""

    _copying = "copying a partition to host memory"  # what a failed copy was doing

    def out_ready(self, wait: bool) -> list[int]:
        return self._poll(wait, self._copying)

    @property
    def outstanding(self) -> int:
        return len(self.pending)


class CudaDirect(_CopiedOut):
    direct = True
    _copying = "copying gradients to host memory"

    def __init__(self, layout: FlatLayout, cuda: Cuda):
        super().__init__(layout, cuda)
        numel = layout.numel
        if layout.wire is None:
            self.host = cuda.pinned(numel)  # copy-out target, then send and receive buffer
        else:
            total = payload_bytes(list(layout.wire))
            self.dev = cuda.empty(numel)  # gradients gathered on the GPU for encoding
            self.dev_payload = cuda.empty(total, torch.uint8)
            self.payload = cuda.pinned(total, torch.uint8)
            self.feedback = ErrorFeedback(numel, cuda.device)

    @_on_device("copying a gradient off the GPU")
    def fill(self, i: int, t: torch.Tensor, lo: int, hi: int) -> list[int]:
        ev = self.cuda.mark()
        a = self.layout.bounds[i]
        with torch.cuda.stream(self.cuda.d2h):
            self.cuda.d2h.wait_event(ev)
            src = self._source(i, t, lo, hi, self.cuda.d2h)
            if self.layout.wire is None:
                self.host[a + lo: a + hi].copy_(src, non_blocking=True)
            else:
                self.dev[a + lo: a + hi].copy_(src)
        return self._count(i, lo, hi)

    @_on_device("copying a partition to host memory")
    def stage_out(self, pid: int) -> None:
        with torch.cuda.stream(self.cuda.d2h):
            if self.layout.wire is not None:
                w = self.layout.wire[pid]
                dp = self.dev_payload[w.offset: w.offset + w.nbytes]
                encode_part(w, self.dev, dp, self.feedback)  # on the GPU: only the payload crosses PCIe
                self.payload[w.offset: w.offset + w.nbytes].copy_(dp, non_blocking=True)
            ev = self.cuda.record(self.cuda.d2h)
        self.pending.append((pid, ev))

    def views(self, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _pinned_views(self, pid)

    @_on_device("copying a sum back to the GPU")
    def stage_in(self, pid: int) -> None:
        with torch.cuda.stream(self.cuda.h2d):
            if self.layout.wire is None:
                for i, lo, hi in self.layout.spans[pid]:
                    a = self.layout.bounds[i]
                    self.src[i][lo - a: hi - a].copy_(self.host[lo:hi], non_blocking=True)
                return
            w = self.layout.wire[pid]
            dp = self.dev_payload[w.offset: w.offset + w.nbytes]
            dp.copy_(self.payload[w.offset: w.offset + w.nbytes], non_blocking=True)
            decode_part(w, dp, self.dev)
            for i, lo, hi in self.layout.spans[pid]:
                a = self.layout.bounds[i]
                self.src[i][lo - a: hi - a].copy_(self.dev[lo:hi])


class CudaWorkHost(_CudaStaging, WorkStaging):
    """Collectives over gloo on CUDA tensors: a pinned work buffer, filled (pre-scaled on
    the GPU) by the copy stream; results go back by the host-to-device stream. The server
    leg is the host work staging's (comm/staging/): the local sum is on the host here, so
    `stage_out`, `out_ready` and `outstanding` are the base staging's (the wire bytes are
    in host memory as soon as they are asked for); the copy stream's events are polled by
    `work_ready`."""

    def __init__(self, layout: FlatLayout, cuda: Cuda):
        super().__init__(layout, cuda)
        numel = layout.numel
        self.work = cuda.pinned(numel)
        self.dev = cuda.empty(numel)  # pre-scaled gradients, before the copy
        self._host_wire()

    @_on_device("copying a gradient off the GPU")
    def fill(self, i: int, t: torch.Tensor, lo: int, hi: int) -> list[int]:
        ev = self.cuda.mark()
        a = self.layout.bounds[i]
        with torch.cuda.stream(self.cuda.d2h):
            self.cuda.d2h.wait_event(ev)
            src = self._source(i, t, lo, hi, self.cuda.d2h)
            if self.scale != 1.0:
                src = torch.mul(src, self.scale, out=self.dev[a + lo: a + hi])
            self.work[a + lo: a + hi].copy_(src, non_blocking=True)
            done = self._count(i, lo, hi)
            for pid in done:
                self.pending.append((pid, self.cuda.record(self.cuda.d2h)))
        return done

    def work_ready(self, wait: bool) -> list[int]:
        return self._poll(wait, "copying gradients to host memory")

    @_on_device("writing results into the gradients")
    def deliver(self, pid: int) -> None:
        with torch.cuda.stream(self.cuda.h2d):
            for i, lo, hi in self.layout.spans[pid]:
                a = self.layout.bounds[i]
                self.src[i][lo - a: hi - a].copy_(self.work[lo:hi], non_blocking=True)


class CudaWorkDevice(_CopiedOut, WorkStaging):
    """Collectives over NCCL: the work buffer is on the GPU, filled on the compute stream.
    Partitions this worker pushes to the servers are copied out after the local reduce
    and back before the local broadcast (which waits on `in_event`)."""

    on_device = True

    def __init__(self, layout: FlatLayout, cuda: Cuda, server_leg: bool = False):
        super().__init__(layout, cuda)
        numel = layout.numel
        self.work = cuda.empty(numel)
        if server_leg and layout.wire is None:
            self.host = cuda.pinned(numel)
        elif server_leg:
            total = payload_bytes(list(layout.wire))
            self.dev_payload = cuda.empty(total, torch.uint8)
            self.payload = cuda.pinned(total, torch.uint8)
            self.feedback = ErrorFeedback(numel, cuda.device)

    def begin(self, scale: float = 1.0) -> None:
        super().begin(scale)
        self.in_events: dict[int, torch.cuda.Event] = {}

    # the work staging's: on the compute stream, which NCCL orders after
    fill = _on_device("copying a gradient off the GPU")(WorkStaging.fill)

    @_on_device("copying a partition to host memory")
    def stage_out(self, pid: int) -> None:
        # called after the transport waited for the local reduce of pid: that wait made the
        # compute stream wait for the collective, so the copy stream waits for the compute
        # stream (a stream wait, never the host; nothing relies on blocking NCCL waits)
        p = self.layout.parts[pid]
        compute = self.cuda.compute()
        with torch.cuda.stream(self.cuda.d2h):
            self.cuda.d2h.wait_stream(compute)
            if self.layout.wire is None:
                self.host[p.start: p.start + p.length].copy_(self.work_view(pid), non_blocking=True)
            else:
                w = self.layout.wire[pid]
                dp = self.dev_payload[w.offset: w.offset + w.nbytes]
                encode_part(w, self.work, dp, self.feedback)
                self.payload[w.offset: w.offset + w.nbytes].copy_(dp, non_blocking=True)
            self.pending.append((pid, self.cuda.record(self.cuda.d2h)))

    def views(self, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _pinned_views(self, pid)

    @_on_device("copying a sum back to the GPU")
    def stage_in(self, pid: int) -> None:
        p = self.layout.parts[pid]
        with torch.cuda.stream(self.cuda.h2d):
            if self.layout.wire is None:
                self.work_view(pid).copy_(self.host[p.start: p.start + p.length], non_blocking=True)
            else:
                w = self.layout.wire[pid]
                dp = self.dev_payload[w.offset: w.offset + w.nbytes]
                dp.copy_(self.payload[w.offset: w.offset + w.nbytes], non_blocking=True)
                decode_part(w, dp, self.work)
            self.in_events[pid] = self.cuda.record(self.cuda.h2d)

    def in_event(self, pid: int):
        return self.in_events.pop(pid, None)

    # the work staging's: results into the gradients on the compute stream, and the
    # tensors without a flat view written whole at the end
    deliver = _on_device("writing results into the gradients")(WorkStaging.deliver)
    complete = WorkStaging.complete
