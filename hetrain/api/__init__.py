"""The user API, modelled on Horovod/BytePS so existing scripts port in a few lines.

Split the way Horovod splits its torch API: `basics` (init, rank, size, device,
shutdown), `ops` (push_pull and its asynchronous form), `functions` (broadcasts of
parameters, optimizer state and objects), `compression`, `optimizer`
(DistributedOptimizer) and `ddp_hook` (the DDP communication hook)."""
from __future__ import annotations

from .basics import device, engine, init, local_rank, local_size, rank, shutdown, size
from .compression import Compression
from .ddp_hook import HookState, ddp_comm_hook
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .ops import poll, push_pull, push_pull_async, synchronize
from .optimizer import DistributedOptimizer

__all__ = ["Compression", "DistributedOptimizer", "HookState", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters", "ddp_comm_hook", "device", "engine", "init", "local_rank", "local_size", "poll",
           "push_pull", "push_pull_async", "rank", "shutdown", "size", "synchronize"]
