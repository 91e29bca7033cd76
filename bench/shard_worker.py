"""The training process `bench/shard.py` launches on every worker (see that file).

Runs each system of `--systems` in turn on one model (a stack of Linear layers, fresh
from the same seed each time), each under this worker's memory cap (`MemoryCap`,
started before the model is built): hetrain's sharding (`hetrain.shard`, the stage,
batch shares and memory weights the planner chose), PyTorch's ZeroRedundancyOptimizer
over DDP (stage 1, even shards, even batch) and FSDP2's `fully_shard` (per Linear, then
the root; even shards, even batch). Systems take turns (`--repeats`); rank 0 writes
per-system step times and every worker's measured peak bytes, per repeat, as JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.train.shard import MemoryCap, ShardConfig, shard


def make_model(width: int, depth: int, device) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers).to(device)


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(v) for v in s.split(","))


def run_system(system: str, a, ctx, emu: EmulatedDevice, cap: MemoryCap) -> dict:
    rank, n = hetrain.rank(), hetrain.size()
    device = hetrain.device()
    if system == "hetrain":
        # built on the host, sharded onto the device unit by unit (a GPU below the replica)
        model = make_model(a.width, a.depth, "cpu")
        batch = _ints(a.batch)[rank]
        opt = shard(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                    ShardConfig(stage=a.stage, weights=_floats(a.weights)), cap=cap, device=device)
        net = model
    else:
        model = make_model(a.width, a.depth, device)
    if system == "hetrain":
        pass
    elif system == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        batch = a.global_batch // n + (rank < a.global_batch % n)
        net = DDP(model, process_group=ctx.worker_group, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                      process_group=ctx.worker_group)
    elif system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        batch = a.global_batch // n + (rank < a.global_batch % n)
        mesh = init_device_mesh(device.type, (n,))
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        raise SystemExit(f"unknown system {system!r}")
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, a.width, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    times = []
    t0 = time.perf_counter()
    for _step in range(a.steps):
        opt.zero_grad()
        if system == "hetrain":
            opt.set_batch_size(batch, total=a.global_batch)
        with emu.compute(batch):
            # every system averages over the global batch: b_i / B of the local mean
            loss = nn.functional.cross_entropy(net(x), y) * (batch * n / a.global_batch
                                                            if system != "hetrain" else 1.0)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        opt.step()
        cap.peak()  # (the high-water mark is kept by the kernel / the allocator)
        times.append(time.perf_counter() - t0)
    dist.barrier(group=ctx.worker_group)
    peak = cap.peak()
    out = {"times": times, "batch": batch, "peak_bytes": peak, "loss": float(loss.item())}
    del opt, net, model, x, y, loss
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--systems", default="hetrain,fsdp2,zero1")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--batch", required=True, help="hetrain's samples per worker, comma-separated")
    p.add_argument("--weights", required=True, help="hetrain's memory weights per worker")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cost", type=float, default=0.02, help="seconds per sample at speed 1")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads of a CPU worker")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ctx = hetrain.init()
    rank = hetrain.rank()
    machine = ctx.topology.proc(rank).machine
    emu = EmulatedDevice(machine.device, machine.name, ctx.env.run_dir, cost_per_sample=a.cost)
    results: dict[str, list] = {}
    systems = a.systems.split(",")
    for system in systems:
        # the same code on a tiny model first: the libraries' code pages it touches and the
        # process groups' first buffers are resident before the cap starts measuring
        tiny = argparse.Namespace(**{**vars(a), "width": 16, "depth": 2, "steps": 2, "cost": 0.0})
        run_system(system, tiny, ctx, EmulatedDevice(machine.device, machine.name),
                   MemoryCap(float("inf"), hetrain.device()))
    # repeats interleave the systems, so a change in the host's load hits them alike
    for _rep in range(a.repeats):
        for system in systems:
            gc.collect()
            cap = MemoryCap(machine.device.memory, hetrain.device(), name=machine.name)
            results.setdefault(system, []).append(run_system(system, a, ctx, emu, cap))
            del cap
    mine = json.dumps({"machine": machine.name, "results": results})
    every = hetrain.allgather_object(mine)
    if rank == 0:
        with open(a.out, "w") as fh:
            fh.write(json.dumps([json.loads(e) for e in every]))


if __name__ == "__main__":
    main()
