"""Digit classification in the style of Horovod's PyTorch MNIST example (scikit-learn's
8x8 digits, nothing is downloaded): a DistributedSampler per worker, learning rate scaled
by the number of workers, metrics averaged over the workers with `hvd.allreduce`. Only the
import line says hetrain (`import horovod.torch as hvd` -> `import hetrain as hvd`).

    hetrain launch examples/horovod/mnist.py --epochs 2
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

import hetrain as hvd

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--test-batch-size", type=int, default=100)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--use-adasum", action="store_true")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
args = parser.parse_args()

hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)

digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
y = torch.tensor(digits.target)
train_dataset, test_dataset = TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])
train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
test_sampler = DistributedSampler(test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
test_loader = DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, t):
        t = F.max_pool2d(F.relu(self.conv(t)), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(t.flatten(1)))), dim=1)


model = Net()
lr_scaler = 1 if args.use_adasum else hvd.size()
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     op=hvd.Adasum if args.use_adasum else hvd.Average,
                                     gradient_predivide_factor=args.gradient_predivide_factor)


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % 10 == 0 and hvd.rank() == 0:
            print(f"epoch {epoch} [{batch_idx * len(data)}/{len(train_sampler)}] loss {loss.item():.4f}", flush=True)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


def test():
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(1) == target).float().sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    accuracy = metric_average(correct / len(test_sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"Test set: average loss {test_loss:.4f}, accuracy {100 * accuracy:.1f}%", flush=True)
    return test_loss, accuracy


for epoch in range(1, args.epochs + 1):
    train(epoch)
    loss, acc = test()
print("RESULT", json.dumps({"rank": hvd.rank(), "loss": loss, "accuracy": acc}), flush=True)
