"""The user API, modelled on Horovod/BytePS so existing scripts port with the import line.

Split the way Horovod splits its torch API: `basics` (init, rank, size, device,
probes, shutdown), `ops` (push_pull and its asynchronous form, BytePS's extras),
`collectives` (Horovod's allreduce, allgather, broadcast, alltoall, reducescatter,
barrier; `reduce_op` and `adasum` for the reductions), `uneven` (join: uneven inputs),
`functions` (broadcasts of parameters, optimizer state and objects; allgather_object),
`compression`, `optimizer` (DistributedOptimizer, with `amp` for GradScaler),
`sync_batch_norm`, `ddp_hook` (the DDP communication hook) and `elastic` (Horovod
Elastic's names on hetrain's elastic machinery, exported as `hetrain.elastic`)."""
from __future__ import annotations

from .basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, device, engine, gloo_built,
                     gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from .collectives import (allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_,
                          alltoall, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                          grouped_allreduce, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                          reducescatter, alltoall_async, reducescatter_async, grouped_allgather,
                          grouped_allgather_async, grouped_reducescatter, grouped_reducescatter_async)
from .compression import Compression
from .ddp_hook import HookState, ddp_comm_hook
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .uneven import join
from .ops import declare, poll, push_pull, push_pull_async, push_pull_inplace, resume, suspend, synchronize
from .optimizer import DistributedOptimizer
from .reduce_op import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .sync_batch_norm import SyncBatchNorm

# one list of the public names: hetrain/__init__.py exports them lazily from here
from .. import _API as _NAMES  # noqa: E402  (the parent package is imported before this one)

__all__ = sorted(_NAMES)
