"""The training process `bench/hetero.py` launches on every worker (see that file).

Subcommands:
  train    digits training through BalancedLoader: balanced (measured step times) or
           equal shares (hetrain), or PyTorch DDP with equal shares; until a target test
           accuracy or for a fixed number of steps; R repeats in one launch (fresh model
           each time); rank 0 writes per-step times, shares, accuracies and every rank's
           forward/backward times as JSON. (Real-compute comparisons with slow devices:
           bench/real_worker.py.)
  overlap  a stack of equal Linear layers whose backward costs a calibrated sleep per
           layer; phases compute-only, communication-only, step without and with
           overlap, interleaved R times.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.demo.digits import load_digits_split
from hetrain.train.loader import BalancedLoader
from hetrain.train.sampler import GlobalBatchSampler


def digits_model(seed: int, width: int = 128) -> nn.Module:
    torch.manual_seed(seed)
    if width == 128:  # the demo's model
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def acc_of(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def cmd_train(a) -> dict:
    ctx = hetrain.init()
    rank, nw = hetrain.rank(), hetrain.size()
    machine = ctx.topology.proc(rank).machine
    device = EmulatedDevice(machine.device, machine.name, ctx.env.run_dir, cost_per_sample=a.cost or None)
    xtr, ytr, xte, yte = load_digits_split()
    runs = []
    # --interleave balanced,equal,ddp: every repeat runs each kind once, in turn, so slow
    # drifts in the host's load hit all kinds alike; otherwise one kind from --balance/--ddp
    kinds = a.interleave.split(",") if a.interleave else ["ddp" if a.ddp else a.balance]
    for rep, kind in [(r, k) for r in range(a.repeats) for k in kinds]:
        ddp = kind == "ddp"
        balance = "equal" if ddp else ("measured" if kind in ("measured", "balanced") else "equal")
        model = digits_model(100 + rep, a.width)
        loader = sampler = None
        if ddp:  # PyTorch DDP, equal shares from the same global batches
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, process_group=ctx.worker_group)
            opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
            sampler = GlobalBatchSampler(len(xtr), a.global_batch, nw, seed=rep)
        else:
            net = model
            opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9),
                                               named_parameters=model.named_parameters())
            loader = BalancedLoader((xtr, ytr), a.global_batch, optimizer=opt, balance=balance, seed=rep,
                                    device="cpu")

        def batches():
            epoch = 0
            while True:
                if loader is not None:
                    yield from loader
                else:
                    for s in range(sampler.steps_per_epoch()):
                        idx = torch.from_numpy(sampler.indices(epoch, s, rank))
                        yield xtr[idx], ytr[idx]
                epoch += 1

        times, accs, computes = [], [], []
        paused = 0.0
        t0 = time.perf_counter()
        step, done = 0, False
        bytes0 = hetrain.engine().stats.bytes_sent + hetrain.engine().stats.bytes_received
        for x, y in batches():
            opt.zero_grad()
            tc = time.perf_counter()
            with device.compute(len(x)):
                if len(x):
                    scale = len(x) * nw / a.global_batch if ddp else 1.0
                    (F.cross_entropy(net(x), y) * scale).backward()
                elif ddp:  # DDP needs every rank in the all-reduce
                    (sum(p.sum() for p in net.parameters()) * 0).backward()
            computes.append(time.perf_counter() - tc)
            opt.step()
            step += 1
            times.append(time.perf_counter() - t0 - paused)
            if a.eval_every and step % a.eval_every == 0:
                tp = time.perf_counter()
                flag = torch.tensor([acc_of(model, xte, yte) if rank == 0 else 0.0], dtype=torch.float64)
                dist.broadcast(flag, src=ctx.topology.worker_ranks[0], group=ctx.worker_group)
                accs.append((step, times[-1], float(flag.item())))
                done = a.target_acc > 0 and flag.item() >= a.target_acc
                paused += time.perf_counter() - tp
            if done or step >= a.max_steps:
                break
        st = hetrain.engine().stats
        if loader is not None:
            loader.finish()
            sizes = [[int(v) for v in h] for h in loader.balancer.history[:step]]
            spreads = loader.spreads[:step]
        else:
            sizes = [[len(p) for p in sampler.split(np.arange(a.global_batch), np.ones(nw))]] * step
            spreads = []
        # every rank's own forward/backward times, gathered (the DDP run has no loader to measure them)
        mine = torch.tensor(computes[:step], dtype=torch.float64)
        allc = [torch.zeros_like(mine) for _ in range(nw)]
        dist.all_gather(allc, mine, group=ctx.worker_group)
        runs.append({"times": times, "sizes": sizes, "accs": accs, "final_acc": acc_of(model, xte, yte),
                     "bytes_per_step": (st.bytes_sent + st.bytes_received - bytes0) / max(1, step),
                     "engine_comm_s": st.comm_s, "engine_wait_s": st.wait_s, "compute_s": device.compute_s,
                     "steps": step, "spreads": spreads, "fwd_bwd_s": [c.tolist() for c in allc],
                     "loader_exchange_s": loader.batches.exchange_s if loader is not None else 0.0,
                     "wall_s": times[-1] if times else 0.0, "kind": kind})
        if ddp:
            dist.barrier(group=ctx.worker_group)
    return {"runs": runs, "global_batch": a.global_batch, "mode": ctx.comm.mode, "codec": ctx.comm.codec,
            "workers": [p.machine.name for p in ctx.topology.workers], "width": a.width,
            "threads": torch.get_num_threads()}


class _SleepGrad(torch.autograd.Function):
    """Identity whose backward costs `seconds` (a calibrated per-layer compute cost)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class SlowStack(nn.Module):
    def __init__(self, layers: int, width: int, bwd_s: float):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.bwd_s = bwd_s

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(_SleepGrad.apply(x, self.bwd_s)))
        return x


def cmd_overlap(a) -> dict:
    ctx = hetrain.init()
    model = SlowStack(a.layers, a.width, a.layer_bwd_s)
    named = list(model.named_parameters())
    plain = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), named_parameters=named,
                                         overlap=False)
    over = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), named_parameters=named,
                                        overlap=True)
    x = torch.randn(a.batch, a.width)
    eng = hetrain.engine()

    def compute_only():
        model.zero_grad()
        model(x).square().mean().backward()

    def comm_only():
        plain.synchronize()  # the gradients from the last backward, no compute around them

    def step(opt):
        opt.zero_grad()
        opt.set_batch_size(a.batch)
        model(x).square().mean().backward()
        opt.step()

    phases = {"compute_s": compute_only, "comm_s": comm_only, "step_plain_s": lambda: step(plain),
              "step_overlap_s": lambda: step(over)}
    out = {k: [] for k in phases}
    hidden = []
    step(plain)  # warm-up: layout, connections
    step(over)
    for _ in range(a.repeats):
        for name, fn in phases.items():
            ts = []
            for _ in range(a.steps):
                dist.barrier(group=ctx.worker_group)
                h0 = eng.stats.hidden_s
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
                if name == "step_overlap_s":
                    hidden.append(eng.stats.hidden_s - h0)
            out[name].append(float(np.median(ts)))
    numel = sum(p.numel() for p in model.parameters())
    return {**out, "hidden_s": hidden, "grad_bytes": numel * 4, "layers": a.layers, "width": a.width}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--balance", choices=["measured", "equal"], default="measured")
    t.add_argument("--ddp", action="store_true")
    t.add_argument("--cost", type=float, default=0.0, help="calibrated seconds per sample at speed 1 (0: real)")
    t.add_argument("--global-batch", type=int, default=256)
    t.add_argument("--lr", type=float, default=0.1)
    t.add_argument("--target-acc", type=float, default=0.0)
    t.add_argument("--max-steps", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=5)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--width", type=int, default=128, help="hidden width (128: the demo's model)")
    t.add_argument("--interleave", default="", help="kinds to alternate in every repeat, e.g. balanced,equal,ddp")
    o = sub.add_parser("overlap")
    o.add_argument("--out", required=True)
    o.add_argument("--layers", type=int, default=12)
    o.add_argument("--width", type=int, default=320)
    o.add_argument("--batch", type=int, default=32)
    o.add_argument("--layer-bwd-s", type=float, default=0.03)
    o.add_argument("--steps", type=int, default=3)
    o.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = cmd_train(a) if a.cmd == "train" else cmd_overlap(a)
    if hetrain.rank() == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result))
    hetrain.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
