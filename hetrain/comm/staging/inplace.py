"""`HostInPlace`: host tensors all-reduced where they lie, with gradient homes."""
from __future__ import annotations

import weakref

import torch

from ..cargo import CARGO_ROOM
from ..flatlayout import FlatLayout
from .base import Staging


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
    copying path, so results never depend on whether the view was kept.

    With an `arena` (the members of a shared-memory all-reduce, comm/shm/arena.py) the
    transport owns the memory: every bucket is buffered, in this process's segment, so
    every fp32 gradient can have its home there and is summed where backward wrote it.
    The arena goes when the staging does (its layout was replaced)."""

    keeps_homes = True

    def __init__(self, layout: FlatLayout, arena=None):
        super().__init__(layout)
        self.arena = arena
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
        for pid in range(len(layout.parts)):  # in order: every member allocates its arena alike
            if len(layout.spans[pid]) > 1 or arena is not None:
                self._buffer(pid)
        if arena is not None:
            weakref.finalize(self, arena.close)

    def _buffer(self, pid: int) -> torch.Tensor:
        p = self.layout.parts[pid]
        # spare room after the bucket, where a cargo's trailer rides without a copy (comm/cargo.py)
        n = p.length + CARGO_ROOM
        self.bases[pid] = torch.empty(n, dtype=torch.float32) if self.arena is None else self.arena.alloc(n)
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
