"""Stages 1-3 with uneven shards and uneven batches on 2 and 3 real processes give the
parameters one process gets from the whole batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hetrain.train.shard import ShardConfig, shard
from tests.shard.procs import data, make_model, reference, spawn

STEPS, BATCH = 4, 12
SPLITS = {2: [8, 4], 3: [6, 2, 4]}          # unequal batch shares (by speed)
WEIGHTS = {2: (3.0, 1.0), 3: (1.0, 5.0, 2.0)}  # unequal memory weights (spans)


def _train_all(rank: int, n: int) -> dict[tuple, list[torch.Tensor]]:
    return {(stage, ex): _train(rank, n, stage, ex) for stage in (1, 2, 3) for ex in ("sum", "owners")}


def _train(rank: int, n: int, stage: int, exchange: str) -> list[torch.Tensor]:
    model = make_model()
    opt = shard(model, torch.optim.Adam(model.parameters(), lr=0.05),
                ShardConfig(stage=stage, weights=WEIGHTS[n], exchange=exchange))
    split = SPLITS[n]
    lo = sum(split[:rank])
    for x, y in data(STEPS, BATCH):
        opt.zero_grad()
        opt.set_batch_size(split[rank])
        xs, ys = x[lo:lo + split[rank]], y[lo:lo + split[rank]]
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    opt.gather_all()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_uneven_shards_equal_one_process(n):
    """Every stage (1, 2, 3), spans exchanged by sums or per owner, in one launch of n
    processes, each from a fresh model."""
    ref = reference(STEPS, BATCH)
    for per_rank in spawn(n, _train_all):
        assert sorted(per_rank) == [(s, e) for s in (1, 2, 3) for e in ("owners", "sum")]
        for stage, got in per_rank.items():
            assert len(got) == len(ref)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage}: {m}")
