"""CPU machines as a memory and optimizer tier: a member training on no samples owns
most of every unit and applies the optimizer step to it on its CPU; the workers keep
thin spans. The step it applies equals the one the workers apply themselves (and one
process's)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hetrain.perf.shardmem import ShardModel, ShardWorker, choose_plan
from hetrain.train.shard import ShardConfig, shard
from tests.shard.procs import data, make_model, reference, spawn

STEPS, BATCH, SPLIT = 4, 12, [8, 4]
MiB = 2**20


def _train(rank: int, n: int, tier: bool) -> dict:
    out = {}
    for stage in (2, 3):
        model = make_model()
        weights = (0.5, 0.5, 6.0) if tier else (1.0, 2.0)
        opt = shard(model, torch.optim.Adam(model.parameters(), lr=0.05), ShardConfig(stage=stage, weights=weights))
        owned = sum(e - s for u in opt.units for s, e in [u.layout.span(rank)])
        for x, y in data(STEPS, BATCH):
            opt.zero_grad()
            if rank < 2:
                lo = sum(SPLIT[:rank])
                opt.set_batch_size(SPLIT[rank], total=BATCH)
                nn.functional.mse_loss(model(x[lo:lo + SPLIT[rank]]), y[lo:lo + SPLIT[rank]]).backward()
            else:  # the CPU tier: no samples, its spans' step
                opt.idle_pass(x[:0], total=BATCH)
            opt.step()
        opt.gather_all()
        out[stage] = ([p.detach().clone() for p in model.parameters()], owned)
    return out


@pytest.mark.slow
def test_cpu_tier_step_equals_the_workers_step():
    ref = reference(STEPS, BATCH)
    with_tier = spawn(3, _train, True)
    workers_only = spawn(2, _train, False)
    total = sum(p.numel() for p in ref)
    for stage in (2, 3):
        assert with_tier[2][stage][1] > 0.8 * total  # the tier owns most of the state
        for params in [r[stage][0] for r in with_tier] + [r[stage][0] for r in workers_only]:
            for a, b in zip(params, ref):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(with_tier[0][stage][0], workers_only[0][stage][0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_planner_puts_the_optimizer_state_on_the_cpu_tier():
    model = ShardModel("m", (1_000_000,) * 8, act_bytes_per_sample=4096.0)
    workers = [ShardWorker("gpu0", 60 * MiB, 0.001), ShardWorker("gpu1", 60 * MiB, 0.001),
               ShardWorker("cpu-tier", 4096 * MiB, float("inf"))]
    plan = choose_plan(model, workers, 64)
    assert plan.batch == (32, 32, 0)  # the tier trains on nothing
    assert plan.shares[2] > 0.9       # and holds nearly all the sharded state
    assert all(p <= w.memory for p, w in zip(plan.peak, workers))
    # without the tier the same GPUs cannot hold the model at any stage
    with pytest.raises(Exception, match="no sharding plan fits"):
        choose_plan(model, workers[:2], 64)
