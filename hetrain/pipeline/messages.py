"""Activations and their gradients between neighbouring stages.

A message is one int64 header (count, then dtype, ndim, dims per tensor; last slot: the
emulated time the data is ready, in µs) and the tensors packed into one float32 and one
int64 buffer, all through comm/p2p.py's guarded gloo send/recv (tags from its pipeline
range, 64 per micro-batch). gloo moves host memory only, so a stage's `Wire` decides how
its tensors get into and out of host buffers: `HostWire` for a CPU stage (the tensors
already are host memory), `pipeline/cuda_wire.py`'s `CudaWire` for a stage on a GPU
(one device-side packing, one copy into a pinned host buffer, one copy back up).
"""
from __future__ import annotations

import torch

from ..comm import p2p

HDR_LEN = 64
DTYPES = {0: torch.float32, 1: torch.int64}
CODES = {v: k for k, v in DTYPES.items()}


def tag(mb: int, i: int) -> int:
    """64 tags per micro-batch in the pipeline range of comm/p2p.py."""
    return p2p.PIPELINE(mb * 64 + i)


class HostWire:
    """A CPU stage: its tensors are host memory already; nothing to stage."""

    device = torch.device("cpu")

    def to_host(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        return flats

    def host_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype)

    def to_device(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def to_cpu(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the stage as host memory (sparse gradients for the shards)."""
        return t

    def from_cpu(self, t: torch.Tensor) -> torch.Tensor:
        """Host memory (pulled embedding rows, generated data) onto the stage's device."""
        return t


def wire_for(device: torch.device, describe: str = "this stage"):
    """The wire of a stage that computes on `device`."""
    if device.type == "cuda":
        from .cuda_wire import CudaWire  # the only CUDA-specific module of the pipeline

        return CudaWire(device, describe)
    return HostWire()


def send_tensors(ts: list[torch.Tensor], dst: int, mb: int, ready_at: float = 0.0, wire=None) -> list:
    """isend the header and the packed tensors; returns (work, buffer) pairs the caller
    keeps until they complete."""
    wire = wire or HostWire()
    h = [len(ts)]
    for t in ts:
        h += [CODES[t.dtype], t.dim(), *t.shape]
    if len(h) > HDR_LEN - 1:
        raise ValueError(f"{len(ts)} tensors do not fit in one message header")
    hdr = torch.zeros(HDR_LEN, dtype=torch.int64)
    hdr[: len(h)] = torch.tensor(h)
    hdr[-1] = int(ready_at * 1e6)
    codes = [code for code, dt in DTYPES.items() if any(t.dtype == dt for t in ts)]
    # packed where the tensors are (one copy each), then to host memory in one go
    flats = wire.to_host([p2p.flatten([t for t in ts if t.dtype == DTYPES[c]], dtype=DTYPES[c]) for c in codes])
    out = [(p2p.isend(hdr, dst, tag(mb, 0)), hdr)]
    for code, flat in zip(codes, flats):
        out.append((p2p.isend(flat, dst, tag(mb, 1 + code), what="sending activations"), flat))
    return out


def recv_tensors(src: int, mb: int, wire=None) -> tuple[list[torch.Tensor], float]:
    """The tensors of one message (on the wire's device), and the emulated time they are
    ready at."""
    wire = wire or HostWire()
    hdr = torch.empty(HDR_LEN, dtype=torch.int64)
    p2p.recv(hdr, src, tag(mb, 0))
    h = hdr.tolist()
    n, pos, metas = h[0], 1, []
    for _ in range(n):
        code, nd = h[pos], h[pos + 1]
        shape = h[pos + 2: pos + 2 + nd]
        pos += 2 + nd
        if code not in DTYPES or nd < 0 or any(d < 0 for d in shape) or pos > HDR_LEN - 1:
            raise RuntimeError(f"malformed activation header from rank {src}")
        metas.append((code, shape))
    views = {}
    for code, dt in DTYPES.items():
        shapes = [sh for c, sh in metas if c == code]
        total = sum(int(torch.Size(sh).numel()) for sh in shapes)
        if total:
            flat = wire.host_buffer(total, dt)
            p2p.recv(flat, src, tag(mb, 1 + code))
            views[code] = iter(p2p.unflatten(wire.to_device(flat), shapes))
    out = [next(views[code]).clone() if code in views else torch.empty(shape, dtype=DTYPES[code], device=wire.device)
           for code, shape in metas]
    return out, h[-1] / 1e6
