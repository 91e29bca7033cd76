"""An MLP on scikit-learn's handwritten digits with DistributedDataParallel, its
gradient buckets exchanged by hetrain's push_pull (a DDP communication hook).

    hetrain launch examples/ddp_digits_hetrain.py --epochs 5
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hetrain

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=5)
ap.add_argument("--batch-size", type=int, default=64, help="global batch, split over the processes")
ap.add_argument("--lr", type=float, default=0.05)
args = ap.parse_args()
ctx = hetrain.init()  # joins the job `hetrain launch` started (plain python: one worker)
rank, world = hetrain.rank(), hetrain.size()
torch.manual_seed(0)
torch.set_num_threads(1)

x, y = load_digits(return_X_y=True)
x = torch.tensor(x / 16.0, dtype=torch.float32)
y = torch.tensor(y)
perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
train = TensorDataset(x[perm[:1400]], y[perm[:1400]])
x_test, y_test = x[perm[1400:]], y[perm[1400:]]

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
ddp = DDP(model, process_group=ctx.worker_group)
ddp.register_comm_hook(hetrain.HookState(), hetrain.ddp_comm_hook)
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
hetrain.shutdown()
