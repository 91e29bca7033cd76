"""The one setting of sharded data parallelism, `ShardConfig`."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ShardConfig(BaseModel):
    """How `hetrain.shard` splits the training state.

    stage: 1 shards the optimizer state, 2 also the gradients (reduced to their owners
    during backward), 3 also the parameters (gathered before each unit's forward, one
    unit prefetched, released after, gathered again for backward).
    weights: one memory weight per worker (each unit's span of worker i is proportional
    to it); unset: by memory, each worker's `memory_bytes` less its `activation_bytes`
    and what it holds whole at this stage (`perf.shardmem.shares_by_memory`).
    memory_bytes: the bytes this worker may use for training; unset: the cluster file's
    `device.memory`, else what the device has free (`runtime.memory.memory_limit`).
    A cap that holds is a `MemoryCap` passed to `hetrain.shard(..., cap=)`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: Literal[1, 2, 3] = 3
    weights: tuple[float, ...] | None = None
    memory_bytes: float | None = Field(default=None, gt=0)
    activation_bytes: float = Field(default=0.0, ge=0)
    prefetch: bool = True
    # how spans travel: "sum", one all-reduce a unit (gradients: everyone gets the sum and
    # keeps its span; parameters: the others' spans zeroed and summed), or "owners", one
    # reduce / broadcast per owner's span (fewer bytes, n times the collectives)
    exchange: Literal["sum", "owners"] = "sum"
