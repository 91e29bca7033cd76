"""Point-to-point plumbing shared by every hetrain protocol: tag ranges, guarded sends
and receives, waits that name the lost peer, and flat packing of tensor lists.

Tags. gloo matches a message by (source, tag), so two protocols that use the same tag
between the same pair of ranks would steal each other's messages. Every protocol takes
its tags from one range reserved in the table below; `reserve` refuses overlapping
ranges, so a collision is an import-time error, not a silent mix-up.

The guard. gloo's send and receive take host memory only: handed a CUDA pointer, gloo's
I/O thread aborts the whole process (`writev ... Bad address`). Every hetrain send and
receive goes through `isend`/`irecv`/`send`/`recv` here, which refuse anything but a CPU
tensor with a UserError naming the tensor, before gloo sees it. CUDA tensors reach the
wire only through the engine's pinned staging buffers (comm/staging/, comm/cuda.py).

Channels. A protocol that talks to a fixed peer (a worker to its summation servers and
back) holds one channel object per peer, chosen once when it starts (comm/shm/select.py
`channels_for`): `GlooChannel` (gloo point-to-point) or, for a worker and a server on
one host, comm/shm/channel.py's `ShmChannel` (the same isend/irecv through a shared-memory
mailbox). Both return works with `wait()` and `is_completed()`, and `wait` below takes
either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist

from ..errors import UserError

TAG_LIMIT = 1 << 31  # gloo tags are int32


@dataclass(frozen=True)
class TagRange:
    """Tags `start .. start+size-1`, owned by one protocol."""

    name: str
    start: int
    size: int

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.size:
            raise ValueError(f"tag {i} is outside the {self.size} tags of {self.name!r}")
        return self.start + i


_RANGES: dict[str, TagRange] = {}


def reserve(name: str, start: int, size: int) -> TagRange:
    """Reserve a tag range for one protocol; overlapping another range is an error."""
    if start < 0 or size < 1 or start + size > TAG_LIMIT:
        raise ValueError(f"tag range {name!r} [{start}, {start + size}) leaves 0..2^31")
    for r in _RANGES.values():
        if start < r.start + r.size and r.start < start + size and r.name != name:
            raise ValueError(f"tag range {name!r} [{start}, {start + size}) overlaps {r.name!r} "
                             f"[{r.start}, {r.start + r.size})")
    _RANGES[name] = TagRange(name, start, size)
    return _RANGES[name]


def ranges() -> list[TagRange]:
    return sorted(_RANGES.values(), key=lambda r: r.start)


# The registry: every protocol's tags, in one table.
SPARSE_PS = reserve("sparse-ps", 16, 16)  # pipeline/sparse_ps.py: header, ids, rows, grads
ASYNC_PS = reserve("async-ps", 32, 8)  # comm/async_ps.py: control, data, parameters
ANNOUNCE = reserve("announce", 48, 8)  # comm/protocol.py: step announcement and answer
PAIR = reserve("pair-allreduce", 1 << 10, 1 << 12)  # comm/transport.py: a 2-worker bucket swap, by bucket
PIPELINE = reserve("pipeline", 1 << 16, 1 << 20)  # pipeline/worker.py: 64 tags per micro-batch
PARTITIONS = reserve("partitions", 1 << 21, TAG_LIMIT - (1 << 21))  # push_pull partitions, by layout epoch


# ---- the guard -----------------------------------------------------------------------------
def host_only(t: torch.Tensor, what: str) -> torch.Tensor:
    """Refuse a tensor gloo's transport cannot take (it reads and writes host memory only)."""
    if not isinstance(t, torch.Tensor):
        raise UserError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise UserError(f"{what}: a tensor on {t.device} cannot be handed to gloo, which moves host memory only; "
                        "hetrain stages CUDA tensors through pinned host buffers in push_pull and the optimizer "
                        "(use those), or move the tensor to the CPU first")
    return t


def isend(t: torch.Tensor, dst: int, tag: int, group=None, what: str = "send"):
    return dist.isend(host_only(t, what), dst=dst, tag=tag, group=group)


def irecv(t: torch.Tensor, src: int | None, tag: int, group=None, what: str = "receive"):
    return dist.irecv(host_only(t, what), src=src, tag=tag, group=group)


def send(t: torch.Tensor, dst: int, tag: int, group=None, what: str = "send") -> None:
    dist.send(host_only(t, what), dst=dst, tag=tag, group=group)


def recv(t: torch.Tensor, src: int | None, tag: int, group=None, what: str = "receive") -> int:
    return dist.recv(host_only(t, what), src=src, tag=tag, group=group)


class Channel(Protocol):
    """Point-to-point messages to and from one peer (`peer`, a job rank)."""

    peer: int

    def isend(self, t: torch.Tensor, tag: int, group=None, what: str = "send"): ...

    def irecv(self, t: torch.Tensor, tag: int, group=None, what: str = "receive"): ...


@dataclass(frozen=True)
class GlooChannel:
    """gloo's point-to-point to `peer`, on the process group the call names."""

    peer: int

    def isend(self, t: torch.Tensor, tag: int, group=None, what: str = "send"):
        return isend(t, self.peer, tag, group, what)

    def irecv(self, t: torch.Tensor, tag: int, group=None, what: str = "receive"):
        return irecv(t, self.peer, tag, group, what)


# ---- waits that name the lost peer ---------------------------------------------------------
ErrorFactory = Callable[[str, list[int], BaseException], BaseException]


def wait(work, on_error: ErrorFactory | None, what: str, peers: Sequence[int] = ()) -> None:
    """Wait for one request; a broken connection or a timeout becomes `on_error(what,
    peers, err)` (Context.peer_error names the lost rank), raised without the gloo trace.
    An error that names its lost ranks itself (`ranks`: the shared-memory transport's,
    which watched them) is blamed on those."""
    try:
        work.wait()
    except RuntimeError as err:
        if on_error is None:
            raise
        raise on_error(what, list(getattr(err, "ranks", None) or peers), err) from None


def wait_all(works: Iterable, on_error: ErrorFactory | None, what: str, peers: Sequence[int] = ()) -> None:
    """Wait for several requests: plain works (blamed on `peers`) or (peer, work) pairs."""
    for item in works:
        if isinstance(item, tuple):
            peer, work = item[0], item[1]
            wait(work, on_error, what, [peer])
        else:
            wait(item, on_error, what, peers)


class Swap:
    """A two-member all-reduce (sum) of host tensor `t` in one exchange: each member sends
    its whole buffer to the other and adds what it receives (into `scratch`, then `t`).

    Why by hand, when gloo all-reduces: gloo's ring takes two dependent rounds for two
    members (reduce-scatter, then all-gather, half the buffer each), handed to its
    collective thread and back; a swap moves the same bytes per member in one round from
    the calling thread. After compute on a core per worker (socket threads yielding) a
    0.26 to 0.41 MB sum took 0.57 ms as gloo's all-reduce and 0.38 to 0.42 ms as a swap,
    a 4 KB one 0.42 and 0.26 ms (`bench/pair_swap.py`, recorded in bench/results). Both
    members compute a + b in IEEE arithmetic, which commutes, so they hold the same bits,
    as an all-reduce guarantees."""

    def __init__(self, t: torch.Tensor, scratch: torch.Tensor, peer: int, tag: int, group, what: str):
        self.t, self.scratch, self.peer = t, scratch, peer
        self.recv = irecv(scratch, peer, tag, group, what)
        self.send = isend(t, peer, tag, group, what)

    def wait(self) -> None:
        """Both transfers done, then the sum in place (`t` is read by the send until then)."""
        self.recv.wait()
        self.send.wait()
        self.t.add_(self.scratch)


# ---- flat packing --------------------------------------------------------------------------
def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """One contiguous 1-D buffer holding `tensors` back to back (in `dtype`, default the
    first tensor's); written into `out` when given, so a staging buffer can be reused."""
    dtype = dtype or (tensors[0].dtype if tensors else torch.float32)
    numel = sum(t.numel() for t in tensors)
    if out is None:
        device = tensors[0].device if tensors else torch.device("cpu")
        out = torch.empty(numel, dtype=dtype, device=device)
    elif out.numel() != numel:
        raise ValueError(f"flatten: buffer holds {out.numel()} elements, tensors {numel}")
    off = 0
    for t in tensors:
        n = t.numel()
        out[off: off + n].copy_(t.detach().reshape(-1))
        off += n
    return out


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of `flat` with the given shapes, back to back (the inverse of flatten)."""
    out, off = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= int(s)
        out.append(flat[off: off + n].view(*shape))
        off += n
    if off != flat.numel():
        raise ValueError(f"unflatten: shapes cover {off} elements, buffer has {flat.numel()}")
    return out


def copy_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Write a flat buffer back into `tensors` (in place, each in its own dtype)."""
    with torch.no_grad():
        for t, v in zip(tensors, unflatten(flat, [t.shape for t in tensors])):
            t.copy_(v)
