"""Transports: how a worker moves the partitions of one push_pull. Chosen once per job
(`make_transport`), never re-decided per call:

- `ServerTransport`: push each partition to its summation server and pull the sum back
  (gloo point-to-point), under the credit window (comm/window.py).
- `AllReduceTransport`: all-reduce buckets among the workers, asynchronously, each as
  soon as it is complete and the ones before it (in a fixed order) are launched: NCCL for
  CUDA tensors when every worker has a GPU of its own; shared memory when every worker
  runs on one host (comm/shm/); gloo otherwise (transports/collective.py).
- `HierarchicalTransport`: for a machine with several workers (`gpus: N`). The local
  workers first reduce each partition to the one that owns it (balanced bytes,
  comm/flatlayout.py), the owner pushes it to the servers and pulls the sum, and the local
  workers broadcast it from the owner (BytePS's and Horovod's hierarchical scheme; a
  reduce and a broadcast per partition, which is a reduce-scatter and an all-gather with
  uneven pieces). The local group is a parameter: NCCL between a machine's GPUs, gloo for
  emulated devices (how CPU tests run it) and for host tensors. Every worker of a machine
  issues its collectives in one global order, all reduces then all broadcasts (as BytePS
  fixes one order for its NCCL calls), so no two workers interleave them differently.
  Where the machine's workers exchange host buffers, the reduce and the broadcast go
  through shared memory (comm/shm/). The servers see one pusher per machine and weight it
  as the sum of its workers' pre-scaled gradients (comm/protocol.py), so the result stays
  the batch-weighted average.

One module per transport (base.py, server.py, allreduce.py, hierarchical.py) and the
all-reduce's strategies (collective.py). A transport works on a step's staging
(comm/staging/, comm/cuda.py), which owns the buffers; `progress()` never blocks
(called from gradient hooks), `finish()` does.
"""
from __future__ import annotations

from .allreduce import AllReduceTransport
from .base import Arrival, ServerLeg, Transport
from .hierarchical import HierarchicalTransport
from .server import ServerTransport

__all__ = ["AllReduceTransport", "Arrival", "HierarchicalTransport", "ServerLeg", "ServerTransport", "Transport",
           "make_transport"]


def make_transport(ctx, group=None) -> Transport:
    """The job's transport for this worker, decided once from the topology; a subgroup
    (`group`) always all-reduces among its members."""
    if group is not None:
        return AllReduceTransport(ctx, group)
    if not ctx.topology or not ctx.topology.servers:
        return AllReduceTransport(ctx)
    if ctx.local_groups is not None:
        return HierarchicalTransport(ctx)
    return ServerTransport(ctx)
