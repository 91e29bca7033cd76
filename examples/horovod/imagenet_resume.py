"""ImageNet-style training in the style of Horovod's PyTorch ImageNet example, on a small
synthetic image set: several batches per all-reduce (`backward_passes_per_step`),
learning-rate warm-up, metrics averaged over the workers, a checkpoint per epoch on rank
0, and resumption from the newest checkpoint, its epoch broadcast from rank 0. Only the
import line says hetrain (`import horovod.torch as hvd` -> `import hetrain as hvd`).

    hetrain launch examples/horovod/imagenet_resume.py --epochs 2 --checkpoint-format ck-{epoch}.pth.tar
"""
import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hetrain as hvd

parser = argparse.ArgumentParser(description="ImageNet-style example")
parser.add_argument("--checkpoint-format", default="./checkpoint-{epoch}.pth.tar")
parser.add_argument("--batches-per-allreduce", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--base-lr", type=float, default=0.0125)
parser.add_argument("--warmup-epochs", type=float, default=1)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--wd", type=float, default=5e-5)
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()

allreduce_batch_size = args.batch_size * args.batches_per_allreduce
hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)

# the newest checkpoint, found on rank 0 (which writes them) and broadcast to the others
resume_from_epoch = 0
for try_epoch in range(args.epochs, 0, -1):
    if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
        resume_from_epoch = try_epoch
        break
resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0, name="resume_from_epoch").item()
verbose = hvd.rank() == 0

g = torch.Generator().manual_seed(7)
images = torch.randn(256, 3, 12, 12, generator=g)
labels = (images.mean((1, 2, 3)) > 0).long() + 2 * (images[:, 0].mean((1, 2)) > 0).long()
train_dataset = TensorDataset(images[:192], labels[:192])
val_dataset = TensorDataset(images[192:], labels[192:])
train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = DataLoader(train_dataset, batch_size=allreduce_batch_size, sampler=train_sampler)
val_sampler = DistributedSampler(val_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
val_loader = DataLoader(val_dataset, batch_size=args.batch_size, sampler=val_sampler)

model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(3),
                      nn.Flatten(), nn.Linear(72, 4))
optimizer = optim.SGD(model.parameters(), lr=args.base_lr * args.batches_per_allreduce * hvd.size(),
                      momentum=args.momentum, weight_decay=args.wd)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.none,
                                     backward_passes_per_step=args.batches_per_allreduce, op=hvd.Average)
if resume_from_epoch > 0 and hvd.rank() == 0:
    checkpoint = torch.load(args.checkpoint_format.format(epoch=resume_from_epoch))
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)


class Metric:
    """A running average over the batches, each batch's value averaged over the workers."""

    def __init__(self, name):
        self.name, self.sum, self.n = name, torch.tensor(0.0), torch.tensor(0.0)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return (self.sum / self.n).item()


def adjust_learning_rate(epoch, batch_idx):
    if epoch < args.warmup_epochs:
        epoch += float(batch_idx + 1) / len(train_loader)
        lr_adj = 1.0 / hvd.size() * (epoch * (hvd.size() - 1) / args.warmup_epochs + 1)
    else:
        lr_adj = 1.0
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.base_lr * hvd.size() * args.batches_per_allreduce * lr_adj


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    train_loss = Metric("train_loss")
    for batch_idx, (data, target) in enumerate(train_loader):
        adjust_learning_rate(epoch, batch_idx)
        optimizer.zero_grad()
        # split the all-reduce batch into sub-batches of batch_size; gradients accumulate
        for i in range(0, len(data), args.batch_size):
            output = model(data[i:i + args.batch_size])
            loss = F.cross_entropy(output, target[i:i + args.batch_size])
            train_loss.update(loss)
            loss.div_(math.ceil(float(len(data)) / args.batch_size))
            loss.backward()
        optimizer.step()
    if verbose:
        print(f"epoch {epoch + 1}: train loss {train_loss.avg:.4f}", flush=True)


def validate(epoch):
    model.eval()
    val_loss, val_accuracy = Metric("val_loss"), Metric("val_accuracy")
    with torch.no_grad():
        for data, target in val_loader:
            output = model(data)
            val_loss.update(F.cross_entropy(output, target))
            val_accuracy.update((output.argmax(1) == target).float().mean())
    if verbose:
        print(f"epoch {epoch + 1}: val loss {val_loss.avg:.4f}, accuracy {100 * val_accuracy.avg:.1f}%", flush=True)
    return val_loss.avg, val_accuracy.avg


def save_checkpoint(epoch):
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   args.checkpoint_format.format(epoch=epoch + 1))


loss = acc = None
for epoch in range(resume_from_epoch, args.epochs):
    train(epoch)
    loss, acc = validate(epoch)
    save_checkpoint(epoch)
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print("RESULT", json.dumps({"rank": hvd.rank(), "resumed_from": resume_from_epoch, "loss": loss, "accuracy": acc,
                            "weights_sum": weights.sum().item()}), flush=True)
