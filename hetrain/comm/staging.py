"""Staging: between the user's tensors and a transport.

A transport moves partitions of a flat fp32 buffer (comm/flatlayout.py). Staging decides
where those bytes live and how they get there and back:

- *direct* staging (the summation-server path of a machine with one worker): the bytes
  on the wire are made straight from the user's tensors (zero-copy where a partition lies
  inside one contiguous tensor) and results are written straight back;
- *work* staging (all-reduce, and the hierarchical path that first adds the gradients
  of a machine's workers): the gradients are copied, pre-scaled, into a flat work buffer
  on which collectives run, and the results are copied back.

This module holds the host (CPU tensor) stagings and `WorkStaging`, the work buffer's
calls that every work staging shares (host and CUDA alike). CUDA tensors use the
stagings of comm/cuda.py: pinned host buffers, a device-to-host copy stream that waits on an event
recorded when each gradient is ready, and a host-to-device stream the compute stream
waits on, so no device pointer ever reaches gloo and backward is never blocked.

Every staging offers the same calls, used by the transports:

  begin(scale)            a new step (scale: factor applied while filling, work staging)
  fill(i, t, lo, hi)      elements [lo, hi) of tensor i are final; returns the partitions
                          whose every element is now filled
  work_ready(wait)        partitions whose work buffer is complete (collectives may start)
  work_view(pid)          the work buffer of a partition (host or device)
  stage_out(pid)          make the wire bytes of a partition this worker pushes
  out_ready(wait)         partitions whose wire bytes are in host memory
  views(pid)              (send, receive) host tensors of a partition
  stage_in(pid)           its result arrived in the receive view: decode it and put it
                          where it belongs (the user's tensors, or the work buffer)
  deliver(pid)            work buffer -> the user's tensors
  complete(tensors)       end of step: results that could not be written in place
"""
from __future__ import annotations

import torch

from .cargo import CARGO_ROOM
from .compress import ErrorFeedback
from .flatlayout import FlatLayout
from .wire import decode_part, encode_part, payload_bytes


class Staging:
    direct = False
    on_device = False  # the work buffer lives on the GPU (collectives there: NCCL)

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


def _flat_of(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of t when it has one (contiguous), else None."""
    t = t.detach()
    return t.view(-1) if t.is_contiguous() else None


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


class WorkStaging(Staging):
    """Shared by every work staging (host, and CUDA over gloo or NCCL: comm/cuda.py): the
    flat work buffer `self.work` and its partitions' views, the pre-scaled fill on the
    current stream, and, where the work buffer is in host memory, the server leg's wire
    bytes (the buffer itself, or a payload encoded from it with error feedback)."""

    work: torch.Tensor

    def work_view(self, pid: int) -> torch.Tensor:
        p = self.layout.parts[pid]
        return self.work[p.start: p.start + p.length]

    def _fill_work(self, i: int, t: torch.Tensor, lo: int, hi: int) -> list[int]:
        """Elements [lo, hi) of tensor i, times the step's scale, into the work buffer."""
        a = self.layout.bounds[i]
        src = t.detach().reshape(-1)[lo:hi]
        dst = self.work[a + lo: a + hi]
        if self.scale != 1.0:
            torch.mul(src, self.scale, out=dst)
        else:
            dst.copy_(src)
        return self._count(i, lo, hi)

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


class HostWork(WorkStaging):
    """Host tensors into a flat work buffer, pre-scaled, for collectives (all-reduce, or a
    machine's local reduce before its owner pushes to the servers). The server leg sends
    from and receives into the work buffer (through a payload buffer with a codec)."""

    def __init__(self, layout: FlatLayout):
        super().__init__(layout)
        self.work = torch.empty(layout.numel, dtype=torch.float32)
        self._host_wire()

    def begin(self, scale: float = 1.0) -> None:
        super().begin(scale)
        self.targets: dict[int, torch.Tensor | None] = {}

    def fill(self, i: int, t: torch.Tensor, lo: int, hi: int) -> list[int]:
        self.targets[i] = _flat_of(t)
        done = self._fill_work(i, t, lo, hi)
        self._ready.extend(done)
        return done

    def deliver(self, pid: int) -> None:
        for i, lo, hi in self.layout.spans[pid]:
            dst = self.targets.get(i)
            if dst is not None:
                a = self.layout.bounds[i]
                dst[lo - a: hi - a].copy_(self.work[lo:hi])

    def complete(self, tensors) -> None:
        for i, t in enumerate(tensors):
            if self.targets.get(i, 0) is None:  # not contiguous: written whole at the end
                a, b = self.layout.tensor_range(i)
                t.copy_(self.work[a:b].view_as(t))


class HostInPlace(Staging):
    """Host tensors all-reduced where they lie (DDP's `gradient_as_bucket_view` without
    re-pointing the user's `.grad`): a bucket inside one contiguous fp32 tensor is scaled
    in place and all-reduced on that tensor's own memory, so the common case (a bucket per
    large weight) costs no copy and no buffer. A bucket of several tensors (the small ones:
    biases, norms) goes through a buffer of its own, allocated once per layout, so memory
    beyond the model is the size of those buckets, not a copy of every gradient.

    A buffered bucket is packed when its last tensor is ready, in one call (its tensors'
    values are final from their hooks on), and unpacked in one call: per gradient a hook
    then only records a view. A model of many small tensors in one bucket (a transformer's
    projections and norms) so pays two copies per bucket, not a Python round per tensor.

    *Gradient homes* (`homes_for`, PyTorch DDP's `gradient_as_bucket_view`): a gradient
    that lies whole in a buffered bucket can live in the buffer itself, as a view the
    optimizer puts in `.grad` at `zero_grad` (`zero_homes` zeroes the buffers), so that
    backward accumulates into the bucket: such a gradient is neither packed nor unpacked.
    A gradient found elsewhere (`.grad` replaced or set to None by other code) takes the
    copying path, so results never depend on whether the view was kept."""

    def __init__(self, layout: FlatLayout):
        super().__init__(layout)
        if layout.wire is not None:  # pragma: no cover - all-reduce carries fp32 only
            raise ValueError("in-place staging carries fp32 gradients only (codecs need summation servers)")
        self.buffers: dict[int, torch.Tensor] = {}
        self.bases: dict[int, torch.Tensor] = {}  # the buffers' allocations, with their spare room
        # per buffered bucket: its spans as (tensor, first, end) in the tensor's own
        # elements, and the buffer's matching pieces (views made once per layout)
        self.slots: dict[int, list[tuple[int, int, int]]] = {}
        self.pieces: dict[int, list[torch.Tensor]] = {}
        self._slot_of: dict[tuple[int, int], int] = {}  # (bucket, tensor) -> its slot
        self.homes: dict[int, torch.Tensor] = {}  # tensor -> its flat piece of a bucket buffer (homes_for)
        self._shaped: dict[int, torch.Tensor] = {}  # the same, shaped like the parameters
        self._homes_key: object = None
        for pid in range(len(layout.parts)):
            if len(layout.spans[pid]) > 1:
                self._buffer(pid)

    def _buffer(self, pid: int) -> torch.Tensor:
        p = self.layout.parts[pid]
        # spare room after the bucket, where a cargo's trailer rides without a copy (comm/cargo.py)
        self.bases[pid] = torch.empty(p.length + CARGO_ROOM, dtype=torch.float32)
        buf = self.buffers[pid] = self.bases[pid][:p.length]
        spans = self.layout.spans[pid]
        self.slots[pid] = [(i, lo - self.layout.bounds[i], hi - self.layout.bounds[i]) for i, lo, hi in spans]
        self.pieces[pid] = list(torch.split(buf, [hi - lo for _, lo, hi in spans]))
        for k, (i, _lo, _hi) in enumerate(spans):
            self._slot_of[(pid, i)] = k
        return buf

    def begin(self, scale=1.0) -> None:
        """`scale`: a number, or a callable giving it (b_i / Σb once the step header is in:
        asked at the first bucket, so the header runs during forward)."""
        super().begin(1.0)
        self._scale = scale
        self.targets: dict[int, torch.Tensor | None] = {}
        self.storages: set = set()
        self.held: dict[int, list[tuple[int, torch.Tensor]]] = {}  # bucket -> (slot, source) to pack

    def with_room(self, pid: int, extra: int) -> torch.Tensor | None:
        base = self.bases.get(pid)
        return base[:self.layout.parts[pid].length + extra] if base is not None and extra <= CARGO_ROOM else None

    def resolve(self) -> float:
        if callable(self._scale):
            self._scale = float(self._scale())
        return self._scale

    def _target(self, i: int, t: torch.Tensor) -> torch.Tensor | None:
        """The tensor's own memory, where its buckets can be all-reduced in place: not when
        it is not contiguous fp32, nor when it shares storage with an earlier tensor (tied
        or viewed buffers: scaling one would scale the other)."""
        if i not in self.targets:
            t = t.detach()
            storage = t.untyped_storage().data_ptr() if t.numel() else None
            ok = t.is_contiguous() and t.dtype == torch.float32 and (storage is None or storage not in self.storages)
            self.storages.add(storage)
            self.targets[i] = t.view(-1) if ok else None
        return self.targets[i]

    def fill(self, i: int, t: torch.Tensor, lo: int, hi: int) -> list[int]:
        a = self.layout.bounds[i]
        whole = lo == 0 and a + hi == self.layout.bounds[i + 1]  # the common case: from a hook
        home = self.homes.get(i)
        at_home = whole and home is not None and t.data_ptr() == home.data_ptr()  # backward wrote into the bucket
        if at_home:
            self.targets[i] = home
        flat = None if at_home else self._target(i, t)
        src = None
        done = []
        for pid, n in (self.layout.tensor_touches[i] if whole else self.layout.touches(a + lo, a + hi)):
            if not at_home and pid not in self.buffers and flat is None:  # cannot be all-reduced where it lies
                self._buffer(pid)
            if not at_home and pid in self.buffers:
                if src is None:
                    src = flat if flat is not None else t.detach().reshape(-1)
                k = self._slot_of[(pid, i)]
                _, s, e = self.slots[pid][k]
                if whole:  # packed with the rest of the bucket once it is complete
                    self.held.setdefault(pid, []).append((k, src if e - s == len(src) else src[s:e]))
                else:  # a range: copied now
                    s, e = max(s, lo), min(e, hi)
                    self.pieces[pid][k][s - self.slots[pid][k][1]: e - self.slots[pid][k][1]].copy_(src[s:e])
            self.filled[pid] += n
            if self.filled[pid] == self.layout.parts[pid].length:
                self._pack(pid)
                done.append(pid)
        self._ready.extend(done)
        return done

    def arrived(self, i: int, t: torch.Tensor) -> list[int] | None:
        """Tensor i is final and `t` is its home (the view `homes_for` gave): count it in,
        as `fill` would, without looking at its memory (the short path of a gradient hook
        that found backward accumulating into the bucket). Returns the buckets it
        completed, or None when `t` is not this layout's home of tensor i (then `fill`)."""
        if self._shaped.get(i) is not t:
            return None
        (pid, n), = self.layout.tensor_touches[i]
        self.targets[i] = self.homes[i]
        self.filled[pid] += n
        if self.filled[pid] != self.layout.parts[pid].length:
            return []
        self._pack(pid)
        self._ready.append(pid)
        return [pid]

    def _pack(self, pid: int) -> None:
        held = self.held.pop(pid, None)
        if held:
            pieces = self.pieces[pid]
            _copy_all([pieces[k] for k, _ in held], [src for _, src in held])

    def work_view(self, pid: int) -> torch.Tensor:
        """The bucket to all-reduce, scaled by b_i / Σb (called once per bucket, at launch)."""
        view = self.buffers.get(pid)
        if view is None:
            (i, lo, hi), = self.layout.spans[pid]
            a = self.layout.bounds[i]
            view = self.targets[i][lo - a: hi - a]
        scale = self.resolve()
        if scale != 1.0:
            view.mul_(scale)
        return view

    def deliver(self, pid: int) -> None:
        if pid not in self.buffers:
            return
        dsts, srcs = [], []
        for (i, lo, hi), piece in zip(self.slots[pid], self.pieces[pid]):
            dst = self.targets.get(i)
            if dst is not None and dst is not self.homes.get(i):  # a home already holds its result
                dsts.append(dst if hi - lo == dst.numel() else dst[lo:hi])
                srcs.append(piece)
        _copy_all(dsts, srcs)

    def homes_for(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Views of the bucket buffers shaped like `params` (the tensors of this layout, in
        order) for every parameter whose gradient can live in one: fp32 on the host, whole
        inside one buffered bucket. Made once per parameter list."""
        key = tuple(id(p) for p in params)
        if key != self._homes_key:
            homes = {}
            if len(params) == len(self.layout.bounds) - 1:
                for i, p in enumerate(params):
                    touch = self.layout.tensor_touches[i]
                    if (len(touch) != 1 or touch[0][0] not in self.buffers or p.dtype != torch.float32
                            or p.device.type != "cpu" or p.numel() != touch[0][1]):
                        continue
                    homes[i] = self.pieces[touch[0][0]][self._slot_of[(touch[0][0], i)]]
            self.homes, self._homes_key = homes, key
            self._shaped = {i: v.view(params[i].shape) for i, v in homes.items()}
        return self._shaped

    def zero_homes(self) -> None:
        """Zero the buffers that hold gradient homes (their gradients start the step at 0)."""
        for pid in {self.layout.tensor_touches[i][0][0] for i in self.homes}:
            self.buffers[pid].zero_()

    def complete(self, tensors) -> None:
        for i, t in enumerate(tensors):
            if self.targets.get(i, 0) is None:  # not contiguous fp32: its buckets were buffered
                a, b = self.layout.tensor_range(i)
                pieces = []
                for pid, _n in self.layout.touches(a, b):
                    p = self.layout.parts[pid]
                    pieces.append(self.buffers[pid][max(a, p.start) - p.start: min(b, p.start + p.length) - p.start])
                t.copy_(torch.cat(pieces).view_as(t))


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dsts[k] <- srcs[k] for every k, in one call where this torch has `_foreach_copy_`."""
    if len(dsts) > 1 and hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dsts, srcs)
    else:
        for d, s in zip(dsts, srcs):
            d.copy_(s)
