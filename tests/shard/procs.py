"""Real processes for the sharding tests: spawn n gloo workers running a function."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, n: int, port: int, fn, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        out[rank] = fn(rank, n, *args)
    finally:
        dist.destroy_process_group()


def spawn(n: int, fn, *args) -> list:
    """Run `fn(rank, n, *args)` in n processes of one gloo group; their results by rank."""
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_entry, args=(n, free_port(), fn, args, out), nprocs=n, join=True)
        return [out[r] for r in range(n)]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def data(steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)) for _ in range(steps)]


def reference(steps: int, batch: int, lr: float = 0.05) -> list[torch.Tensor]:
    """One process: the whole batch, Adam; the parameters after the steps."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for x, y in data(steps, batch):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
