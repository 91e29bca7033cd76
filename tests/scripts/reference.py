"""Shared by the multi-process training script and its single-process reference."""
import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 6
GLOBAL_BATCH = 24


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(200, 32, generator=g), torch.randint(0, 10, (200,), generator=g)


def global_batch(step):
    return torch.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)


def shares(total, n):
    """Unequal per-worker batch sizes: worker i gets (i+1) parts."""
    parts = [(i + 1) for i in range(n)]
    sizes = [total * p // sum(parts) for p in parts]
    sizes[-1] += total - sum(sizes)
    return sizes


def single_process(batches=None, momentum: float = 0.9):
    """One process on the whole global batches (default: STEPS batches in data order)."""
    x, y = data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for idx in (batches if batches is not None else [global_batch(s) for s in range(STEPS)]):
        idx = torch.as_tensor(idx)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return model.state_dict()
