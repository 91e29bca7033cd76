"""An MLP on scikit-learn's handwritten digits with DistributedDataParallel over gloo,
started torchrun-style (or as one process with plain python).

    torchrun --nproc-per-node 2 examples/ddp_digits.py --epochs 5
    python examples/ddp_digits.py --epochs 5
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=5)
ap.add_argument("--batch-size", type=int, default=64, help="global batch, split over the processes")
ap.add_argument("--lr", type=float, default=0.05)
args = ap.parse_args()
if "RANK" in os.environ:  # started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    dist.init_process_group("gloo")
else:  # plain python: a group of one process
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
torch.set_num_threads(1)

x, y = load_digits(return_X_y=True)
x = torch.tensor(x / 16.0, dtype=torch.float32)
y = torch.tensor(y)
perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
train = TensorDataset(x[perm[:1400]], y[perm[:1400]])
x_test, y_test = x[perm[1400:]], y[perm[1400:]]

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=1, drop_last=True)
loader = DataLoader(train, batch_size=args.batch_size // world, sampler=sampler, drop_last=True)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.cross_entropy(ddp(xb), yb)
        loss.backward()
        opt.step()

with torch.no_grad():
    logits = model(x_test)
    result = {"accuracy": (logits.argmax(1) == y_test).float().mean().item(),
              "loss": F.cross_entropy(logits, y_test).item()}
print("RESULT", json.dumps(result))
dist.destroy_process_group()
