"""The demo: a digits classifier (scikit-learn's 8x8 handwritten digits, shipped with
the package, nothing downloaded) trained on the built-in heterogeneous cluster.

Run it with `hetrain demo` (or `hetrain launch -m hetrain.demo.digits`); with plain
`python -m hetrain.demo.digits` it trains as a single worker.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.train.balance import BalanceConfig, Balancer, estimate_memory_per_sample
from hetrain.train.metrics import StepLogger
from hetrain.train.sampler import GlobalBatchSampler
from hetrain.train.summary import format_table, gather_stats, write_summary


def load_digits_split(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(), torch.from_numpy(xte), torch.from_numpy(yte).long())


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--cost-per-sample", type=float, default=0.0005,
                    help="emulated compute: seconds per sample at speed 1 (calibrated device model, so compute "
                         "grows with the batch as on a real accelerator); 0 stretches the real compute instead")
    ap.add_argument("--balance", choices=["measured", "equal"], default="measured",
                    help="batch shares: follow each worker's measured samples/s (default) or equal")
    ap.add_argument("--commit-every", type=int, default=5,
                    help="commit the elastic state every N steps (0: never); a restarted job resumes there")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # slow imports and data loading before joining the job: once it has joined, the
    # summation servers wait for this worker's first step no longer than the peer timeout
    xtr, ytr, xte, yte = load_digits_split()
    from torch.utils.tensorboard import SummaryWriter

    ctx = hetrain.init()
    rank, nw = hetrain.rank(), hetrain.size()
    run_dir = ctx.env.run_dir if ctx.env else "runs/single"
    machine = ctx.topology.proc(rank).machine if ctx.topology else None
    device = (EmulatedDevice(machine.device, machine.name, run_dir, cost_per_sample=args.cost_per_sample or None)
              if machine else None)

    model = make_model()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                       named_parameters=model.named_parameters())
    sampler = GlobalBatchSampler(len(xtr), args.global_batch, nw, seed=1)
    # model, optimizer and data position continue from the last commit after a restart
    # (hetrain launch --max-restarts); rank 0's initial weights otherwise
    state = hetrain.elastic.State(model=model, optimizer=opt, sampler=sampler)
    # balancing keeps synchronous workers finishing together; async workers run at their own pace
    # memory: activations per sample (measured with forward hooks) and parameters, grads, momentum
    per_sample = estimate_memory_per_sample(model, xtr[:1])
    reserved = 3.0 * sum(p.numel() * p.element_size() for p in model.parameters())
    # a restarted round starts balancing afresh for its own (possibly fewer) workers
    balancer = (Balancer(ctx, args.global_batch, BalanceConfig(memory_per_sample=per_sample, reserved_bytes=reserved))
                if args.balance == "measured" and ctx.comm.sync == "sync" else None)
    writer = None
    if rank == 0:
        writer = SummaryWriter(os.path.join(run_dir, "tb"))
    steplog = StepLogger(ctx, run_dir, writer)
    counts = {"samples": 0, "steps": 0}

    @hetrain.elastic.run
    def train(state) -> None:
        from tqdm import tqdm

        bar = tqdm(total=args.epochs, initial=sampler.epoch, desc="epochs", file=sys.stdout, disable=rank != 0,
                   ascii=True, mininterval=0)
        for epoch in sampler.epochs(args.epochs):
            for s in sampler.steps():
                if args.commit_every and s % args.commit_every == 0:
                    state.commit()  # at the top of the step: the committed position is this step
                step = sampler.global_step
                shares = balancer.sizes if balancer is not None else None
                idx = torch.from_numpy(sampler.indices(epoch, s, rank, shares))
                opt.zero_grad()
                opt.set_batch_size(len(idx))  # before backward: --overlap pushes from the gradient hooks
                t_c = time.perf_counter()
                if device is not None:
                    device.check_memory(len(idx), per_sample, reserved)
                    with device.compute(len(idx)):
                        loss = F.cross_entropy(model(xtr[idx]), ytr[idx]) if len(idx) else None
                        if loss is not None:
                            loss.backward()
                else:
                    loss = F.cross_entropy(model(xtr[idx]), ytr[idx]) if len(idx) else None
                    if loss is not None:
                        loss.backward()
                compute_s = time.perf_counter() - t_c
                opt.step()
                if balancer is not None:
                    balancer.record(len(idx), compute_s)
                    balancer.update()
                steplog.log(step, len(idx), compute_s, hetrain.engine().stats)
                counts["samples"] += len(idx)
                counts["steps"] += 1
                if writer is not None and loss is not None:
                    writer.add_scalar("train/loss", loss.item(), step + 1)
            acc = accuracy(model, xte, yte)
            if rank == 0:
                bar.update(1)
                bar.set_postfix(test_acc=f"{acc:.3f}")
                writer.add_scalar("test/accuracy", acc, epoch)
        bar.close()
        if args.commit_every:
            state.commit()  # the finished job: a restart from here trains no more

    t_start = time.perf_counter()
    train(state)
    samples, step = counts["samples"], counts["steps"]
    wall = time.perf_counter() - t_start
    st = hetrain.engine().stats
    mine = {"samples": samples, "steps": step, "wall_s": wall, "compute_s": device.compute_s if device else 0.0,
            "comm_s": st.comm_s, "wait_s": st.wait_s, "bytes": st.bytes_sent + st.bytes_received}
    rows = gather_stats(ctx, mine)
    if rank == 0:
        acc = accuracy(model, xte, yte)
        total = sum(r["samples"] for r in rows)
        sps = total / wall
        labels = [ctx.topology.proc(i).machine.name if ctx.topology else "w0" for i in range(nw)]
        print(f"\ndigits demo: test accuracy {acc:.4f} after {args.epochs} epochs; {sps:.0f} samples/s; "
              f"mode {ctx.comm.mode}; {nw} workers")
        print(format_table(rows, labels))
        print("per-rank shares and time split (hidden = communication that ran during backward, --overlap):")
        print(steplog.summary())
        path = write_summary(run_dir, {"accuracy": acc, "samples_per_s": sps, "epochs": args.epochs,
                                       "mode": ctx.comm.mode, "ranks": dict(zip(labels, rows))})
        print(f"summary: {path}; TensorBoard: tensorboard --logdir {os.path.join(run_dir, 'tb')}")
        writer.add_scalar("summary/samples_per_s", sps, 0)
        writer.close()
    steplog.close()
    hetrain.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
