"""Synthetic-data throughput benchmark in the style of Horovod's PyTorch examples. It is a
Horovod script: only its import line says hetrain (`import horovod.torch as hvd` ->
`import hetrain as hvd`).

    hetrain launch examples/horovod/synthetic_benchmark.py --num-iters 3
"""
import argparse
import json
import timeit

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import hetrain as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark")
parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression during allreduce")
parser.add_argument("--use-adasum", action="store_true", help="use Adasum to combine the workers' updates")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size per worker")
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=3)
parser.add_argument("--num-iters", type=int, default=3)
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)

model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                      nn.Linear(8 * 16, 10))
# Adasum needs no learning-rate scaling; an average over N workers takes N times the rate
lr_scaler = 1 if args.use_adasum else hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 16, 16)
target = torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Batch size: {args.batch_size}, number of workers: {hvd.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
rates = []
for it in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    rate = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iter #{it}: {rate:.1f} img/sec per worker")
    rates.append(rate)
total = hvd.allreduce(torch.tensor(sum(rates) / len(rates)), op=hvd.Sum).item()
log(f"Total img/sec on {hvd.size()} worker(s): {total:.1f}")
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print("RESULT", json.dumps({"rank": hvd.rank(), "total": total, "weights_sum": weights.sum().item()}), flush=True)
