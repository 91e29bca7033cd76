"""The staging calls every staging offers (`Staging`, with host-memory defaults) and the
work buffer's calls every work staging shares (`WorkStaging`: host and CUDA alike).
The calls and what each staging does are described in comm/staging/__init__.py."""
from __future__ import annotations

import torch

from ..compress import ErrorFeedback
from ..flatlayout import FlatLayout
from ..wire import decode_part, encode_part, payload_bytes


class Staging:
    direct = False
    on_device = False  # the work buffer lives on the GPU (collectives there: NCCL)
    keeps_homes = False  # tensors may arrive in their gradient homes (`arrived`; HostInPlace)
    # partitions become ready after `fill` returns (copies on a stream: comm/cuda.py), so
    # the transport polls at every tensor handed over; host stagings say so in `fill`
    polled = False

    def __init__(self, layout: FlatLayout):
        self.layout = layout
        self.filled = [0] * len(layout.parts)
        self.scale = 1.0
        self._ready: list[int] = []
        self._out: list[int] = []

    def begin(self, scale: float = 1.0) -> None:
        self.scale = float(scale)
        self.filled = [0] * len(self.layout.parts)
        self._ready, self._out = [], []

    def _count(self, i: int, lo: int, hi: int) -> list[int]:
        a = self.layout.bounds[i]
        whole = lo == 0 and a + hi == self.layout.bounds[i + 1]
        touch = self.layout.tensor_touches[i] if whole else self.layout.touches(a + lo, a + hi)
        done = []
        for pid, n in touch:
            self.filled[pid] += n
            if self.filled[pid] == self.layout.parts[pid].length:
                done.append(pid)
        return done

    # defaults for host memory: everything is ready as soon as it is asked for
    def work_ready(self, wait: bool) -> list[int]:
        out, self._ready = self._ready, []
        return out

    def stage_out(self, pid: int) -> None:
        self._out.append(pid)

    def out_ready(self, wait: bool) -> list[int]:
        out, self._out = self._out, []
        return out

    @property
    def outstanding(self) -> int:
        """stage_out calls whose bytes out_ready has not returned yet."""
        return len(self._out)

    def resolve(self) -> float:
        """The scale of this step (work stagings that learn it late wait for it here)."""
        return self.scale

    def arrived(self, i: int, t: torch.Tensor) -> list[int] | None:
        """A gradient home of tensor i is final (see `HostInPlace.arrived`); None: this
        staging keeps no homes, hand it over with `fill`."""
        return None

    def in_event(self, pid: int):
        """What a device collective on the work buffer must wait for after stage_in (None: nothing)."""
        return None

    def with_room(self, pid: int, extra: int) -> torch.Tensor | None:
        """Partition `pid`'s work buffer extended by `extra` elements of its own spare room
        (a trailer rides there: comm/cargo.py), or None where it has none."""
        return None



class WorkStaging(Staging):
    """Shared by every work staging (host, and CUDA over gloo or NCCL: comm/cuda.py): the
    flat work buffer `self.work` and its partitions' views, the pre-scaled fill on the
    current stream, and, where the work buffer is in host memory, the server leg's wire
    bytes (the buffer itself, or a payload encoded from it with error feedback)."""

    work: torch.Tensor

    def work_view(self, pid: int) -> torch.Tensor:
        p = self.layout.parts[pid]
        return self.work[p.start: p.start + p.length]

    def begin(self, scale: float = 1.0) -> None:
        super().begin(scale)
        self.users: dict[int, torch.Tensor] = {}  # tensor index -> the user's tensor, where its result goes

    def fill(self, i: int, t: torch.Tensor, lo: int, hi: int) -> list[int]:
        """Elements [lo, hi) of tensor i, times the step's scale, into the work buffer on
        the current stream (a device buffer's collectives are ordered after it there), so
        the partitions it completes are ready at once. The copy is inline, not a helper:
        this runs once per gradient per step, so a call saved here is saved a few
        hundred times a step on a large model."""
        td = t.detach()
        self.users[i] = td
        a = self.layout.bounds[i]
        src = td.reshape(-1)[lo:hi]
        dst = self.work[a + lo: a + hi]
        if self.scale != 1.0:
            torch.mul(src, self.scale, out=dst)
        else:
            dst.copy_(src)
        done = self._count(i, lo, hi)
        self._ready.extend(done)
        return done

    def deliver(self, pid: int) -> None:
        """Partition `pid`'s result into the user's tensors that have a flat view
        (contiguous ones); the others are written whole by `complete`."""
        for i, lo, hi in self.layout.spans[pid]:
            t = self.users.get(i)
            if t is not None and t.is_contiguous():
                a = self.layout.bounds[i]
                t.view(-1)[lo - a: hi - a].copy_(self.work[lo:hi])

    def complete(self, tensors) -> None:
        for i, t in self.users.items():
            if not t.is_contiguous():
                a, b = self.layout.tensor_range(i)
                t.copy_(self.work[a:b].view_as(t))

    def _host_wire(self) -> None:
        """Payload buffers and error feedback in host memory, for a codec on the host."""
        if self.layout.wire is not None:
            total = payload_bytes(list(self.layout.wire))
            self.psend = torch.zeros(total, dtype=torch.uint8)
            self.precv = torch.zeros(total, dtype=torch.uint8)
            self.feedback = ErrorFeedback(self.layout.numel)

    def views(self, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, receive) of a partition from a host work buffer (see _host_wire)."""
        if self.layout.wire is None:
            v = self.work_view(pid)
            return v, v
        w = self.layout.wire[pid]
        sbuf = self.psend[w.offset: w.offset + w.nbytes]
        encode_part(w, self.work, sbuf, self.feedback)
        return sbuf, self.precv[w.offset: w.offset + w.nbytes]

    def stage_in(self, pid: int) -> None:
        if self.layout.wire is not None:
            w = self.layout.wire[pid]
            decode_part(w, self.precv[w.offset: w.offset + w.nbytes], self.work)

