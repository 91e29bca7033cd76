"""Sharded data parallelism with uneven shards (ZeRO stages 1-3, FSDP-style units).

`hetrain.shard(model, optimizer, ShardConfig(stage=3))` returns a `ShardedOptimizer`.
Modules: `layout` (who owns which span: pure), `collectives` (reduce to owners and
gather from owners on torch.distributed, gloo included), `unit` (one unit's flat
buffer), `sharded` (hooks and the step), `checkpoint` (save on n workers, load on m),
`cap` (a memory cap that holds). The memory model and planner: `perf/shardmem.py`.
"""
from __future__ import annotations

from .cap import MemoryCap, MemoryCapError
from .config import ShardConfig
from .sharded import ShardedOptimizer


def shard(model, optimizer, config: ShardConfig | None = None, group=None, cap: MemoryCap | None = None,
          device=None) -> ShardedOptimizer:
    """Shard `model`'s training state over the job's workers (after `hetrain.init()`;
    in a plain torch.distributed job, over `group`); returns the optimizer to step.
    `cap`: hold this worker to a memory cap (start it before building the model).
    `device`: move the parameters there unit by unit (a model built on the host for a
    GPU smaller than its replica); unset: where they are. Buffers are not moved."""
    import torch.distributed as dist

    if group is None and dist.is_available() and dist.is_initialized():
        from ...runtime import context
        ctx = context._CTX  # hetrain.init() ran: its workers' group (summation servers left out)
        group = getattr(ctx, "worker_group", None) if ctx is not None else None
    return ShardedOptimizer(model, optimizer, config or ShardConfig(), group=group, cap=cap, device=device)


__all__ = ["MemoryCap", "MemoryCapError", "ShardConfig", "ShardedOptimizer", "shard"]
