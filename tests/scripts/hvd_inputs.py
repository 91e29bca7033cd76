"""What each rank feeds the Horovod-API calls in hvd_calls.py; the test builds its
single-process references from the same functions."""
import torch
import torch.nn as nn

OPS = ["Average", "Sum", "Min", "Max", "Product", "Adasum"]
STEPS = 4


def tensor(rank, i, shape=(5, 3)):
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(shape, generator=g)


def gather_rows(rank):
    return torch.full((rank + 1, 2), float(rank)) + torch.arange(2.0)


def a2a_splits(rank, n):
    return [(rank + j) % 2 + 1 for j in range(n)]


def a2a_input(rank, n):
    rows = sum(a2a_splits(rank, n))
    return torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) + 100 * rank


def bn_batch(rank):
    g = torch.Generator().manual_seed(77 + rank)
    return torch.randn(3 + rank, 4, 2, generator=g) * (rank + 1) + rank


def uneven_steps(rank):
    """How many steps each rank has before it joins."""
    return 2 + rank


def model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(rank, step, rows=4):
    g = torch.Generator().manual_seed(500 + 10 * step + rank)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)
