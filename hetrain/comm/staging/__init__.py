"""Staging: between the user's tensors and a transport.

A transport moves partitions of a flat fp32 buffer (comm/flatlayout.py). Staging decides
where those bytes live and how they get there and back:

- *direct* staging (the summation-server path of a machine with one worker): the bytes
  on the wire are made straight from the user's tensors (zero-copy where a partition lies
  inside one contiguous tensor) and results are written straight back;
- *work* staging (all-reduce, and the hierarchical path that first adds the gradients
  of a machine's workers): the gradients are copied, pre-scaled, into a flat work buffer
  on which collectives run, and the results are copied back.

The parts of this package:

- `base.py`: `Staging`, the calls every staging offers (and their host-memory defaults),
  and `WorkStaging`, the work buffer's calls that every work staging shares (host and
  CUDA alike);
- `host.py`: the host (CPU tensor) stagings for summation servers and for collectives on
  a work buffer (`HostDirect`, `HostWork`);
- `inplace.py`: `HostInPlace`, host tensors all-reduced where they lie, with gradient homes.

CUDA tensors use the stagings of comm/cuda.py: pinned host buffers, a device-to-host copy
stream that waits on an event recorded when each gradient is ready, and a host-to-device
stream the compute stream waits on, so no device pointer ever reaches gloo and backward
is never blocked.

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
from .base import Staging, WorkStaging
from .host import HostDirect, HostWork
from .inplace import HostInPlace

__all__ = ["HostDirect", "HostInPlace", "HostWork", "Staging", "WorkStaging"]
