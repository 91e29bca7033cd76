"""Host (CPU tensor) stagings for the summation servers (`HostDirect`) and for collectives
on a flat work buffer (`HostWork`). The all-reduce's in-place staging is in inplace.py."""
from __future__ import annotations

import weakref

import torch

from ..compress import ErrorFeedback
from ..flatlayout import FlatLayout
from ..wire import decode_part, encode_part, payload_bytes
from .base import Staging, WorkStaging


class HostDirect(Staging):
    """Host tensors straight to the servers: a partition inside one contiguous tensor is
    sent from that tensor and its result received straight into it (the result can only
    arrive after the server has every worker's push, so after the send has read it); one
    that spans tensors is copied into a staging buffer when it is sent. With a codec each
    partition is encoded into a payload buffer (error feedback kept per element)."""

    direct = True

    def __init__(self, layout: FlatLayout):
        super().__init__(layout)
        numel = layout.numel
        self.send = torch.empty(numel, dtype=torch.float32)
        self.recv = torch.empty(numel, dtype=torch.float32)
        if layout.wire is not None:
            total = payload_bytes(list(layout.wire))
            self.psend = torch.zeros(total, dtype=torch.uint8)
            self.precv = torch.zeros(total, dtype=torch.uint8)
            self.feedback = ErrorFeedback(numel)

    def begin(self, scale: float = 1.0) -> None:
        if scale != 1.0:  # pragma: no cover - the servers weight direct pushes
            raise ValueError("direct staging sends gradients unscaled; the servers weight them")
        super().begin(scale)
        self.flat: dict[int, torch.Tensor] = {}
        self.inplace: dict[int, bool] = {}
        self.storages: set = set()
        self.direct_pid: dict[int, bool] = {}

    def fill(self, i: int, t: torch.Tensor, lo: int, hi: int) -> list[int]:
        if i not in self.flat:
            t = t.detach()
            storage = t.untyped_storage().data_ptr() if t.numel() else None
            # a tensor sharing storage with an earlier one (tied or viewed buffers) is sent from
            # a snapshot: the earlier one's result may land in that memory before it is read;
            # so is one that is not fp32 (the wire carries fp32)
            inplace = (t.is_contiguous() and t.dtype == torch.float32
                       and (storage is None or storage not in self.storages))
            self.storages.add(storage)
            self.inplace[i] = inplace
            self.flat[i] = t.view(-1) if inplace else torch.empty(t.numel(), dtype=torch.float32)
        if not self.inplace[i]:
            self.flat[i][lo:hi].copy_(t.detach().reshape(-1)[lo:hi])
        return self._count(i, lo, hi)

    def views(self, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.layout.parts[pid]
        spans = self.layout.spans[pid]
        if self.layout.wire is None and len(spans) == 1:  # inside one tensor: zero-copy
            i, lo, hi = spans[0]
            a = self.layout.bounds[i]
            sbuf = self.flat[i][lo - a: hi - a]
            self.direct_pid[pid] = self.inplace[i]
            return sbuf, (sbuf if self.inplace[i] else self.recv[lo:hi])
        self.direct_pid[pid] = False
        for i, lo, hi in spans:
            a = self.layout.bounds[i]
            self.send[lo:hi].copy_(self.flat[i][lo - a: hi - a])
        if self.layout.wire is None:
            return self.send[p.start: p.start + p.length], self.recv[p.start: p.start + p.length]
        w = self.layout.wire[pid]
        sbuf = self.psend[w.offset: w.offset + w.nbytes]
        encode_part(w, self.send, sbuf, self.feedback)
        return sbuf, self.precv[w.offset: w.offset + w.nbytes]

    def stage_in(self, pid: int) -> None:
        """Write the result into the user's tensors as soon as it arrives (unless it was
        received in place), so complete() has no copy of the model left."""
        if self.layout.wire is not None:
            w = self.layout.wire[pid]
            decode_part(w, self.precv[w.offset: w.offset + w.nbytes], self.recv)
        if self.direct_pid.get(pid):
            return
        for i, lo, hi in self.layout.spans[pid]:
            if self.inplace[i]:
                a = self.layout.bounds[i]
                self.flat[i][lo - a: hi - a].copy_(self.recv[lo:hi])

    def complete(self, tensors) -> None:
        for i, t in enumerate(tensors):
            if not self.inplace.get(i, True):
                a, b = self.layout.tensor_range(i)
                t.copy_(self.recv[a:b].view_as(t))



class HostWork(WorkStaging):
    """Host tensors into a flat work buffer, pre-scaled, for collectives (all-reduce, or a
    machine's local reduce before its owner pushes to the servers). The server leg sends
    from and receives into the work buffer (through a payload buffer with a codec).

    With an `arena` (the machine's workers on one host, comm/shm/arena.py) the work buffer
    is allocated in this process's shared segment, so the local reduce and broadcast run
    on it where it lies; the arena goes when the staging does."""

    def __init__(self, layout: FlatLayout, arena=None):
        super().__init__(layout)
        self.arena = arena
        if arena is None:
            self.work = torch.empty(layout.numel, dtype=torch.float32)
        else:
            self.work = arena.alloc(layout.numel)
            weakref.finalize(self, arena.close)
        self._host_wire()
