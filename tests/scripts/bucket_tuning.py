"""All-reduce job whose gradients (1.6 MB) make two bucket plans: DDP's two buckets and
one bucket. Trains STEPS steps of SGD with momentum and unequal batch sizes, overlap on,
gradients in their buckets, while the engine tunes its buckets; saves the parameters and
what the tuner did, and the scheduling class of gloo's socket threads after training."""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import hetrain

STEPS, GLOBAL = 30, 24


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 640), nn.ReLU(), nn.Linear(640, 600), nn.ReLU(), nn.Linear(600, 10))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * GLOBAL, 32, generator=g), torch.randint(0, 10, (STEPS * GLOBAL,), generator=g)


def reference():
    x, y = data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        idx = torch.arange(step * GLOBAL, (step + 1) * GLOBAL)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return model.state_dict()


if __name__ == "__main__":
    hetrain.init()
    rank, n = hetrain.rank(), hetrain.size()
    x, y = data()
    model = make_model()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters())
    sizes = [GLOBAL // 3, GLOBAL - GLOBAL // 3]  # unequal shares of two workers
    buckets = []
    for step in range(STEPS):
        lo = step * GLOBAL + sum(sizes[:rank])
        mine = torch.arange(lo, lo + sizes[rank])
        opt.set_batch_size(len(mine), total=GLOBAL)
        opt.zero_grad()
        (F.cross_entropy(model(x[mine]), y[mine])).backward()
        opt.step()
        buckets.append(len(opt.engine._layout.parts))
    tuner = opt.engine._tuner
    from hetrain.runtime.commthreads import loop_threads

    idle = [os.sched_getscheduler(t) == getattr(os, "SCHED_IDLE", -1) for t in loop_threads()]
    torch.save({"state": model.state_dict(), "buckets": buckets, "tried": len(tuner.times),
                "times": tuner.times, "done": tuner.done, "loop_idle": idle}, sys.argv[1] + f".rank{rank}.pt")
    hetrain.shutdown()
