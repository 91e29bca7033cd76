"""Rank 1 runs out of data a step early and ends without hetrain.join(): both workers
must stop with the clear error, not wait for each other until the timeout."""
import torch
import torch.nn.functional as F

import hetrain as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(3 - hvd.rank()):
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 0])).backward()
    opt.step()
