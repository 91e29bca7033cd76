"""Synthetic-data benchmark in the style of BytePS's PyTorch examples. It is a BytePS
script: only its import line says hetrain (`import byteps.torch as bps` ->
`import hetrain as bps`).

    hetrain launch examples/byteps/synthetic_benchmark.py --num-iters 3
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import hetrain as bps

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=3)
parser.add_argument("--num-iters", type=int, default=3)
args = parser.parse_args()

bps.init()
torch.manual_seed(1)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = optim.SGD(model.parameters(), lr=0.01)
optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=bps.Compression.none)
bps.broadcast_parameters(model.state_dict(), root_rank=0)
bps.broadcast_optimizer_state(optimizer, root_rank=0)
data, target = torch.randn(args.batch_size, 64), torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


for _ in range(args.num_warmup_batches):
    benchmark_step()
rates = []
for it in range(args.num_iters):
    t0 = time.time()
    for _ in range(args.num_batches_per_iter):
        benchmark_step()
    rates.append(args.batch_size * args.num_batches_per_iter / (time.time() - t0))
    if bps.rank() == 0:
        print(f"Iter #{it}: {rates[-1]:.1f} img/sec per worker", flush=True)
# BytePS's own way of adding the workers' rates: push_pull with average=False
total = bps.push_pull(torch.tensor([sum(rates) / len(rates)]), average=False, name="img_sec").item()
if bps.rank() == 0:
    print(f"Total img/sec on {bps.size()} worker(s): {total:.1f}", flush=True)
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print("RESULT", json.dumps({"rank": bps.rank(), "total": total, "weights_sum": weights.sum().item()}), flush=True)
