"""Digit classification in the style of BytePS's PyTorch MNIST example (scikit-learn's
8x8 digits, nothing is downloaded): metrics averaged with `bps.push_pull`, a tensor
reduced in place with `bps.push_pull_inplace` after `bps.declare`, an object from rank 0
with `bps.broadcast_object`. Only the import line says hetrain (`import byteps.torch as
bps` -> `import hetrain as bps`).

    hetrain launch examples/byteps/mnist.py --epochs 2
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hetrain as bps

parser = argparse.ArgumentParser(description="BytePS-style digits example")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.02)
args = parser.parse_args()

bps.init()
torch.manual_seed(42)
torch.set_num_threads(1)
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
train_dataset, test_dataset = TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])
train_sampler = DistributedSampler(train_dataset, num_replicas=bps.size(), rank=bps.rank())
train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
test_sampler = DistributedSampler(test_dataset, num_replicas=bps.size(), rank=bps.rank(), shuffle=False)
test_loader = DataLoader(test_dataset, batch_size=100, sampler=test_sampler)

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = optim.SGD(model.parameters(), lr=args.lr * bps.size(), momentum=0.5)
bps.broadcast_parameters(model.state_dict(), root_rank=0)
bps.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
config = bps.broadcast_object({"log_every": 10} if bps.rank() == 0 else None, root_rank=0)
bps.declare("seen")
seen = torch.zeros(1)


def metric_average(val, name):
    return bps.push_pull(torch.tensor(val), name=name).item()


for epoch in range(1, args.epochs + 1):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        seen += len(data)
        if batch_idx % config["log_every"] == 0 and bps.rank() == 0:
            print(f"epoch {epoch} batch {batch_idx} loss {loss.item():.4f}", flush=True)
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.cross_entropy(output, target, reduction="sum").item()
            correct += (output.argmax(1) == target).float().sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
    if bps.rank() == 0:
        print(f"Test set: average loss {test_loss:.4f}, accuracy {100 * accuracy:.1f}%", flush=True)
bps.push_pull_inplace(seen, average=False, name="seen")  # samples seen by all workers together
print("RESULT", json.dumps({"rank": bps.rank(), "loss": test_loss, "accuracy": accuracy, "seen": seen.item()}),
      flush=True)
