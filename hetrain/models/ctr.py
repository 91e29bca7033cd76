"""DLRM-like click-through-rate model: sparse ID features -> embedding tables ->
dot interaction with a bottom MLP over dense features -> top MLP -> logit.

Inputs: ``dense`` (B, n_dense) float32 and ``ids`` (B, n_tables, bag) int64 (ids of
table t in column t; multi-hot bags are sum-pooled). Each embedding table is its own
sparse layer, so a planner can put the tables on CPU machines (a sharded sparse
parameter server in the runtime) and the MLPs on GPUs.

Tables declared larger than ``rows_cap`` are allocated with ``rows_cap`` rows (ids are
hashed modulo the allocated rows) so the model fits on a small machine; the declared
size is kept in ``declared_rows`` and is what the profiler counts as parameter bytes.
"""
from __future__ import annotations

import torch
from torch import nn

from .chain import ChainLayer, ChainModel

# Cardinalities of the 26 categorical features of the Criteo Kaggle display-ads data
# (as used in DLRM's benchmark configuration).
CRITEO_KAGGLE_ROWS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
                      8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
                      286181, 105, 142572)


class BottomMLP(ChainLayer):
    kind = "dense"

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, dense, ids, *pooled):
        return (torch.relu(self.fc(dense)), ids, *pooled)


class EmbeddingLookup(ChainLayer):
    """Table ``index``: looks up column ``index`` of ids, appends the pooled vector;
    the last table drops the ids from the state."""

    kind = "sparse"

    def __init__(self, index: int, rows: int, dim: int, rows_cap: int, last: bool, sparse_grad: bool):
        super().__init__()
        self.index = index
        self.declared_rows = int(rows)
        self.rows = int(min(rows, rows_cap))
        self.last = last
        self.table = nn.EmbeddingBag(self.rows, dim, mode="sum", sparse=sparse_grad)
        nn.init.uniform_(self.table.weight, -(rows ** -0.5), rows ** -0.5)

    def forward(self, dense, ids, *pooled):
        v = self.table(ids[:, self.index, :] % self.rows)
        return (dense, *pooled, v) if self.last else (dense, ids, *pooled, v)


class DotInteraction(ChainLayer):
    """Pairwise dot products of the dense vector and all pooled embeddings."""

    kind = "memory"

    def forward(self, dense, *pooled):
        feats = torch.stack((dense, *pooled), dim=1)                 # (B, F, D)
        z = torch.bmm(feats, feats.transpose(1, 2))                  # (B, F, F)
        f = feats.shape[1]
        iu = torch.triu_indices(f, f, offset=1, device=z.device)
        return (torch.cat([dense, z[:, iu[0], iu[1]]], dim=1),)


class TopMLP(ChainLayer):
    kind = "dense"

    def __init__(self, n_in: int, n_out: int, act: bool = True):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.act = act

    def forward(self, x):
        y = self.fc(x)
        return (torch.relu(y) if self.act else y,)


class CTRModel(ChainModel):
    def __init__(self, table_rows=CRITEO_KAGGLE_ROWS, dim: int = 64, n_dense: int = 13,
                 bottom=(512, 256), top=(512, 256), bag: int = 1, rows_cap: int = 20000,
                 sparse_grad: bool = True):
        table_rows = tuple(int(r) for r in table_rows)
        if not table_rows or min(table_rows) < 1:
            raise ValueError("table_rows needs at least one table with >= 1 row")
        self.dim, self.n_dense, self.n_tables, self.bag = dim, n_dense, len(table_rows), bag
        self.table_rows = table_rows
        layers: list[tuple[str, ChainLayer]] = []
        sizes = (n_dense, *bottom, dim)
        for i in range(len(sizes) - 1):
            layers.append((f"bottom{i}", BottomMLP(sizes[i], sizes[i + 1])))
        for t, rows in enumerate(table_rows):
            layers.append((f"emb{t}", EmbeddingLookup(t, rows, dim, rows_cap, t == len(table_rows) - 1,
                                                      sparse_grad)))
        layers.append(("interact", DotInteraction()))
        f = len(table_rows) + 1
        n_int = dim + f * (f - 1) // 2
        sizes = (n_int, *top, 1)
        for i in range(len(sizes) - 1):
            layers.append((f"top{i}", TopMLP(sizes[i], sizes[i + 1], act=i < len(sizes) - 2)))
        super().__init__(layers)

    def example_inputs(self, batch: int, generator: torch.Generator | None = None):
        dense = torch.randn(batch, self.n_dense, generator=generator)
        ids = torch.randint(0, 2**31 - 1, (batch, self.n_tables, self.bag), generator=generator)
        return dense, ids

    def loss(self, output, target):
        return nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target.float())
