"""The GPU path of sharding on the CUDA stand-in (tests/cudastandin): a model built on the
host and sharded onto worker 0's "GPU" unit by unit, beside a CPU worker; the gloo
exchanges of device buffers go through host copies. Equals one process, and the
stand-in's race checker finds no unordered access. Stage 2: the stand-in marks device
memory by its storage, which releasing a stage-3 unit (`untyped_storage().resize_(0)`)
replaces, so stage 3 on a device is left to a real GPU (`bench/shard.py --gpu`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.shard.procs import data, make_model, reference, spawn

SPLIT, BATCH, STEPS, STAGE = [8, 4], 12, 3, 2


def _train(rank: int, n: int) -> tuple[list[torch.Tensor], list[str]]:
    from tests.cudastandin import standin

    standin.install(1)
    from hetrain.train.shard import ShardConfig, shard

    device = torch.device("cuda:0") if rank == 0 else torch.device("cpu")
    model = make_model()
    opt = shard(model, torch.optim.Adam(model.parameters(), lr=0.05), ShardConfig(stage=STAGE, weights=(1.0, 3.0)),
                device=device)
    assert all(p.device.type == device.type for p in model.parameters())
    lo = sum(SPLIT[:rank])
    for x, y in data(STEPS, BATCH):
        opt.zero_grad()
        opt.set_batch_size(SPLIT[rank], total=BATCH)
        xs, ys = x[lo:lo + SPLIT[rank]].to(device), y[lo:lo + SPLIT[rank]].to(device)
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    opt.gather_all()
    params = [p.detach().cpu().clone() for p in model.parameters()]
    return params, standin.uninstall()


@pytest.mark.slow
def test_gpu_worker_beside_a_cpu_worker_equals_one_process():
    ref = reference(STEPS, BATCH)
    for params, races in spawn(2, _train):
        assert races == [], "\n".join(races)
        for a, b in zip(params, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
