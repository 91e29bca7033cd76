"""A GPU stage's side of the wire: pinned host memory between the GPU and gloo.

gloo moves host memory only (comm/p2p.py refuses anything else), so the activations a
GPU stage sends and the gradients it returns are packed on the GPU, copied into a pinned
host buffer and sent from there; what it receives lands in a pinned buffer and goes up
to the GPU in one asynchronous copy. Buffers come from PyTorch's caching pinned-memory
allocator (`comm.cuda.Cuda.pinned`), which keeps a buffer out of reuse until the copies
queued on it have run, so a buffer can be dropped as soon as its copy is queued. A CUDA
failure becomes `DeviceLostError` naming the rank and its GPU (comm/cuda.py), as in the
engine's staging.
"""
from __future__ import annotations

import torch

from ..comm.cuda import Cuda, DeviceLostError

_ERRORS = (getattr(torch, "AcceleratorError", RuntimeError),)


class CudaWire:
    def __init__(self, device: torch.device, describe: str = "this stage"):
        self.device = device
        self.cuda = Cuda(device, describe)

    def _guard(self, what: str, fn, *args):
        try:
            return fn(*args)
        except DeviceLostError:
            raise
        except _ERRORS as err:
            raise self.cuda.lost(what, err) from None

    def to_host(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device buffers -> pinned host buffers; returns once the bytes are in host
        memory (gloo reads them as soon as the send is posted)."""
        def run():
            hosts = []
            for f in flats:
                h = self.cuda.pinned(f.numel(), f.dtype)
                h.copy_(f, non_blocking=True)
                hosts.append(h)
            self.cuda.done(self.cuda.record(self.cuda.compute()), True, "copying activations to host memory")
            return hosts
        return self._guard("copying activations to host memory", run)

    def host_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self._guard("allocating a pinned buffer", self.cuda.pinned, n, dtype)

    def to_device(self, flat: torch.Tensor) -> torch.Tensor:
        """A received host buffer onto the GPU (queued on the compute stream: whatever
        computes on it next is ordered after the copy)."""
        return self._guard("copying activations to the GPU", lambda: flat.to(self.device, non_blocking=True))

    def to_cpu(self, t: torch.Tensor) -> torch.Tensor:
        return self._guard("copying sparse gradients to host memory", lambda: t.detach().cpu())

    def from_cpu(self, t: torch.Tensor) -> torch.Tensor:
        """Host memory (generated data, pulled embedding rows) onto the GPU."""
        return self._guard("copying inputs to the GPU", lambda: t.to(self.device, non_blocking=t.is_pinned()))
