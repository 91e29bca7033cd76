"""Elastic training in the style of Horovod's elastic PyTorch examples: the model,
optimizer, sampler and position live in `hvd.elastic.TorchState`, committed every few
batches; when a worker fails, the job restarts from the last commit and the reset
callback rescales the learning rate to the new number of workers. Only the import line
says hetrain (`import horovod.torch as hvd` -> `import hetrain as hvd`).

    hetrain launch --max-restarts 2 examples/horovod/elastic.py --epochs 2

`--fail-once FILE` makes rank 1 crash once mid-epoch (when FILE does not exist yet; it
creates it), to see the restart.
"""
import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

import hetrain as hvd

parser = argparse.ArgumentParser(description="elastic example")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--batches-per-commit", type=int, default=2)
parser.add_argument("--fail-once", default=None)
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)

g = torch.Generator().manual_seed(3)
x = torch.randn(160, 10, generator=g)
y = (x[:, :5].sum(1) > 0).long()
train_dataset = TensorDataset(x, y)
train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=1)
train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)

model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):
        if state.batch == 0:
            state.train_sampler.set_epoch(state.epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            state.train_sampler.record_batch(batch_idx, args.batch_size)
            state.batch += 1
            if args.fail_once and hvd.rank() == 1 and state.epoch == 1 and state.batch == 3 \
                    and not os.path.exists(args.fail_once):
                open(args.fail_once, "w").close()
                os._exit(1)  # a worker lost mid-epoch
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        state.batch = 0
        state.losses.append(loss.item())
    return loss.item()


def on_state_reset():
    for param_group in optimizer.param_groups:  # the new world may have another size
        param_group["lr"] = args.lr * hvd.size()
    resets.append(hvd.size())


resets = []
state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=0, batch=0, losses=[])
state.register_reset_callbacks([on_state_reset])
final = train(state)
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print("RESULT", json.dumps({"rank": hvd.rank(), "loss": final, "resets": resets, "epochs": state.epoch + 1,
                            "weights_sum": weights.sum().item()}), flush=True)
