"""The math of one stage replica, on its device: shared by the pipeline worker and the
real-device profiler (`pipeline/hostprofile.py`), so what is profiled is what runs.

A stage holds layers start..end-1 of the runtime's CTR model. Its embedding lookups
(`EmbeddingLookup` in the model) are replaced by `PSEmbedding`: the table lives on the
sparse-PS shards; per micro-batch the stage gathers the distinct keys of all its tables,
pulls those rows (host memory, from the shards), runs the lookups on them as one leaf
tensor on the stage's device, and after backward pushes that tensor's gradient (distinct
rows only). Dense layers live on the stage's device (`wire.device`: the CPU, or the
replica's GPU).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
import torch
from torch import nn

from .sparse_ps import ShardLayout


class PSEmbedding(nn.Module):
    """Stands in for `EmbeddingLookup` in the runtime: the table lives on the shards;
    ``rows`` (pulled for this micro-batch) and ``inv`` (each ID's index in it) are set
    before the stage runs."""

    def __init__(self, orig):
        super().__init__()
        self.index, self.last = orig.index, orig.last
        self.rows: torch.Tensor | None = None
        self.inv: torch.Tensor | None = None

    def forward(self, dense, ids, *pooled):
        v = nn.functional.embedding_bag(self.inv, self.rows, mode="sum")
        return (dense, *pooled, v) if self.last else (dense, ids, *pooled, v)


@dataclass
class Pulled:
    """A micro-batch's embedding rows: the distinct keys (host) and the leaf tensor the
    lookups read (on the stage's device), whose gradient goes back to the shards."""

    keys: torch.Tensor
    rows: torch.Tensor


@dataclass
class Prepared:
    """A micro-batch whose rows are being pulled: keys, each ID's index in them per
    table, and the pull in flight."""

    keys: torch.Tensor
    inv: torch.Tensor
    pending: object


class LocalRows:
    """Rows from an in-process shard (the profiler's stand-in for `SparseClient`)."""

    def __init__(self, shard):
        self.shard = shard

    def start(self, keys, step):
        return self.shard.pull(keys)

    def wait(self, pending):
        return pending

    def push(self, keys, grad, step):
        self.shard.push(keys, grad)


class StageCompute:
    """Layers start..end-1 of `model` on `wire.device`. `rows` serves the embedding rows:
    `start(keys, step)` posts a pull of distinct keys (host), `wait(pending)` returns
    their rows (host), `push(keys, grad, step)` sends their gradient (host); the
    `SparseClient` of the shards, or `LocalRows`."""

    def __init__(self, model, start: int, end: int, layout: ShardLayout, wire, rows=None):
        self.model, self.start, self.end = model, start, end
        self.layout, self.wire, self.rows = layout, wire, rows
        self.embs = []
        for li in range(start, end):
            if hasattr(model.layers[li], "table"):
                model.layers[li] = PSEmbedding(model.layers[li])
                self.embs.append(li)
        self.layers = model.layers[start:end]
        self.layers.to(wire.device)
        self.params = [p for layer in self.layers for p in layer.parameters()]
        self.names = [f"{start + i}.{n}" for i, layer in enumerate(self.layers) for n, _ in layer.named_parameters()]
        self.pull_s = 0.0  # seconds spent waiting for pulled rows

    def prepare(self, inputs: list[torch.Tensor], step: int) -> Prepared | None:
        """Start pulling the rows a micro-batch needs (None: the stage has no lookups)."""
        if not self.embs:
            return None
        ids = inputs[1]
        keys = torch.stack([self.layout.keys(self.model.layers[li].index, ids[:, self.model.layers[li].index, :])
                            for li in self.embs], 0)
        uniq, inv = torch.unique(keys, return_inverse=True)
        host_keys = self.wire.to_cpu(uniq)
        return Prepared(host_keys, inv, self.rows.start(host_keys, step))

    def forward(self, inputs: list[torch.Tensor], step: int,
                prepared: Prepared | None = None) -> tuple[list[torch.Tensor], Pulled | None]:
        """Run the stage on one micro-batch (inputs on the stage's device; `prepared`: its
        pull, if already started)."""
        pulled = None
        if self.embs:
            prepared = prepared or self.prepare(inputs, step)
            t0 = time.perf_counter()
            got = self.rows.wait(prepared.pending)
            self.pull_s += time.perf_counter() - t0
            rows = self.wire.from_cpu(got).requires_grad_(True)
            for j, li in enumerate(self.embs):
                self.model.layers[li].rows, self.model.layers[li].inv = rows, prepared.inv[j]
            pulled = Pulled(prepared.keys, rows)
        return list(self.model.run_range(self.start, self.end, *inputs)), pulled

    def push(self, pulled: Pulled | None, step: int) -> None:
        """After backward: the gradient of the micro-batch's rows to the shards."""
        if pulled is not None:
            self.rows.push(pulled.keys, self.wire.to_cpu(pulled.rows.grad), step)
