"""Which staging a device's tensors take, for the transport chosen for this worker: host
tensors go direct to the servers, through a work buffer, or are all-reduced in place
(comm/staging/), in buckets the transport allocates where it owns their memory (the
shared segments of one host's processes); CUDA tensors take comm/cuda.py's stagings (pinned buffers over gloo, or
a work buffer on the GPU where NCCL carries the collectives)."""
from __future__ import annotations

import torch

from ...runtime.context import Context
from ..cargo import CARGO_ROOM
from ..flatlayout import FlatLayout
from ..staging import HostDirect, HostInPlace, HostWork, Staging
from ..transport import AllReduceTransport, HierarchicalTransport, Transport


def staging_for(ctx: Context, transport: Transport, layout: FlatLayout, device: torch.device,
                cuda=None) -> tuple[Staging, object]:
    """A new staging of `layout` for tensors on `device`, and the `comm.cuda.Cuda` of this
    worker's GPU (`cuda`, made here at the first CUDA staging and kept by the caller)."""
    host = device.type == "cpu"
    if isinstance(transport, AllReduceTransport):  # every member asks: they agree on the answer
        arena = transport.collective.arena_for(layout, host, [p.length + CARGO_ROOM for p in layout.parts])
    elif isinstance(transport, HierarchicalTransport) and transport.shm is not None:  # the machine's workers
        arena = transport.shm.arena_for(layout, host, [layout.numel])
    else:
        arena = None
    if device.type == "cuda":
        return _cuda_staging(ctx, transport, layout, device, cuda)
    st = (HostDirect(layout) if transport.direct else
          HostInPlace(layout, arena) if isinstance(transport, AllReduceTransport) else HostWork(layout, arena))
    return st, cuda


def _cuda_staging(ctx: Context, transport: Transport, layout: FlatLayout, device: torch.device,
                  cuda) -> tuple[Staging, object]:
    from .. import cuda as cuda_mod  # the only CUDA-specific module: imported where CUDA tensors are pushed

    if cuda is None:
        cuda = cuda_mod.Cuda(device, ctx.describe(ctx.rank))
    if transport.direct:
        return cuda_mod.CudaDirect(layout, cuda), cuda
    nccl = (transport.device_work if isinstance(transport, AllReduceTransport)
            else ctx.backends.local.get(ctx.machine_name) == "nccl")
    if nccl:
        return cuda_mod.CudaWorkDevice(layout, cuda, server_leg=isinstance(transport, HierarchicalTransport)), cuda
    return cuda_mod.CudaWorkHost(layout, cuda), cuda
