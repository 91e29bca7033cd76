"""A small CNN on scikit-learn's 8x8 handwritten digits, in one process.

    python examples/digits_cnn.py --epochs 4
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=4)
ap.add_argument("--batch-size", type=int, default=64)
ap.add_argument("--lr", type=float, default=0.005)
args = ap.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)

x, y = load_digits(return_X_y=True)
x = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
y = torch.tensor(y)
perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
train = TensorDataset(x[perm[:1400]], y[perm[:1400]])
x_test, y_test = x[perm[1400:]], y[perm[1400:]]

model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.Adam(model.parameters(), lr=args.lr)
loader = DataLoader(train, batch_size=args.batch_size, drop_last=True,
                    sampler=RandomSampler(train, generator=torch.Generator().manual_seed(1)))

for epoch in range(args.epochs):
    for xb, yb in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()

with torch.no_grad():
    logits = model(x_test)
    result = {"accuracy": (logits.argmax(1) == y_test).float().mean().item(),
              "loss": F.cross_entropy(logits, y_test).item()}
print("RESULT", json.dumps(result))
