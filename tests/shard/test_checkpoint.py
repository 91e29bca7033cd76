"""A sharded checkpoint saved on 3 workers resumes on 2 (other spans, other batches)
and continues exactly as one process would."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from hetrain.train.shard import ShardConfig, shard
from tests.shard.procs import data, make_model, reference, spawn

BATCH = 12


def _run(rank: int, n: int, stage: int, weights, split, steps: range, directory: str, load: bool, save: bool):
    model = make_model(seed=7 if load else 0)  # a resumed job starts from other values: the checkpoint wins
    opt = shard(model, torch.optim.Adam(model.parameters(), lr=0.05), ShardConfig(stage=stage, weights=weights))
    if load:
        opt.load(directory)
    lo = sum(split[:rank])
    batches = data(steps.stop, BATCH)
    for i in steps:
        x, y = batches[i]
        opt.zero_grad()
        opt.set_batch_size(split[rank], total=BATCH)
        nn.functional.mse_loss(model(x[lo:lo + split[rank]]), y[lo:lo + split[rank]]).backward()
        opt.step()
    if save:
        opt.save(directory)
    opt.gather_all()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 1])
def test_saved_on_three_resumes_on_two(tmp_path, stage):
    d = str(tmp_path / "ckpt")
    spawn(3, _run, stage, (1.0, 4.0, 2.0), [6, 2, 4], range(0, 2), d, False, True)
    got = spawn(2, _run, stage, (2.0, 1.0), [5, 7], range(2, 4), d, True, False)
    ref = reference(4, BATCH)
    for params in got:
        for a, b in zip(params, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
