"""The CPU memory cap: a checked budget on the resident set that fails loudly, and a
one-worker sharded run (no process group) that trains like plain Adam."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hetrain
from hetrain.errors import UserError
from hetrain.train.shard import MemoryCap, MemoryCapError
from tests.shard.procs import data, make_model, reference, spawn

MiB = 2**20


def test_cap_measures_what_was_touched_and_fails_loudly():
    cap = MemoryCap(16 * MiB, name="w2")
    cap.check("before")  # nothing allocated yet: within the cap
    big = torch.ones(64 * MiB // 4)  # 64 MiB, every page touched
    assert cap.peak() >= 60 * MiB
    with pytest.raises(MemoryCapError, match=r"w2: memory peaked at .* \(step\), above its cap of 16.0 MiB"):
        cap.check("step")
    del big
    cap.reset()
    cap.check("after reset")  # the high-water mark restarts at the resident size


def test_cap_refuses_a_size_that_holds_nothing():
    with pytest.raises(UserError, match="positive size"):
        MemoryCap(0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_worker_sharded_equals_plain_adam(stage):
    model = make_model()
    opt = hetrain.shard(model, torch.optim.Adam(model.parameters(), lr=0.05), hetrain.ShardConfig(stage=stage,
                                                                                                   weights=(1.0,)))
    for x, y in data(4, 12):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.gather_all()
    for a, b in zip(model.parameters(), reference(4, 12)):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)


def _past_cap(rank: int, n: int) -> str:
    cap = MemoryCap(1 * MiB, name="tiny")
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))  # 1 MiB of parameters each
    try:
        opt = hetrain.shard(model, torch.optim.Adam(model.parameters()), hetrain.ShardConfig(stage=3, weights=(1.0,)),
                            cap=cap)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 512)).sum().backward()
            opt.step()
    except MemoryCapError as err:
        return str(err)
    return "no error"


def test_a_sharded_run_past_its_cap_stops_with_the_cap_error():
    """In a fresh process, as a worker is: the resident set counts what the C heap keeps,
    and a process that ran other work first may reuse its freed heap without growing."""
    got, = spawn(1, _past_cap)
    assert got.startswith("tiny: memory peaked"), got


def test_weights_by_memory_and_their_count_checked():
    model = make_model()
    opt = hetrain.shard(model, torch.optim.Adam(model.parameters()),
                        hetrain.ShardConfig(stage=2, memory_bytes=64 * MiB, activation_bytes=1 * MiB))
    # one worker: its room is its budget less its activations and what it holds whole at stage 2
    n = sum(p.numel() for p in model.parameters())
    assert len(opt.weights) == 1 and 0 < opt.weights[0] < 63 * MiB
    assert opt.units[0].layout.spans[0] == (0, opt.units[0].layout.numel)
    assert sum(u.layout.numel for u in opt.units) == n
    with pytest.raises(UserError, match="2 entries but the job has 1 workers"):
        hetrain.shard(make_model(), torch.optim.Adam(make_model().parameters()),
                      hetrain.ShardConfig(stage=1, weights=(1.0, 2.0)))
