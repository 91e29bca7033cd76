"""The demo: a digits classifier (scikit-learn's 8x8 handwritten digits, shipped with
the package, nothing downloaded) trained on the built-in heterogeneous cluster.

On a machine with CUDA, `hetrain demo` trains on that GPU plus CPU workers of the same
host (real devices, measured shares); elsewhere on 4 workers of emulated speeds.

Run it with `hetrain demo` (or `hetrain launch -m hetrain.demo.digits`); with plain
`python -m hetrain.demo.digits` it trains as a single worker.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.train.loader import BalancedLoader
from hetrain.train.metrics import StepLogger
from hetrain.train.summary import (ActivationMeter, StepClock, check_plan, emulated_speeds, format_table,
                                   gather_stats, model_facts, profile_steps, state_bytes, write_summary)


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


def _parser() -> argparse.ArgumentParser:
    """The demo's command line: training length and rate, emulated compute, balancing, commits."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--cost-per-sample", type=float, default=0.0005,
                    help="emulated compute: seconds per sample at speed 1 (calibrated device model, so compute "
                         "grows with the batch as on a real accelerator); 0: real compute (stretched by the "
                         "device's emulated speed, if below 1)")
    ap.add_argument("--balance", choices=["measured", "equal"], default="measured",
                    help="batch shares: follow each worker's measured step time (default) or equal")
    ap.add_argument("--commit-every", type=int, default=5,
                    help="commit the elastic state every N steps (0: never); a restarted job resumes there")
    return ap


def _report(args, ctx, model: nn.Module, xte: torch.Tensor, yte: torch.Tensor, rows: list[dict], wall: float,
            loader: BalancedLoader, steplog: StepLogger, clock: StepClock, acts: ActivationMeter, writer,
            run_dir: str) -> None:
    """Rank 0's end of run: accuracy and throughput, the per-worker table and time split, the
    plan's predicted versus measured step (after `hetrain launch --auto`), and the run's
    summary file and TensorBoard scalars."""
    nw = hetrain.size()
    acc = accuracy(model, xte, yte)
    total = sum(r["samples"] for r in rows)
    sps = total / wall
    labels = list(ctx.topology.worker_labels) if ctx.topology else ["w0"]
    devices = [d.label() for d in loader.balancer.devices]
    spread = steplog.spread_median()
    speeds = emulated_speeds(ctx)
    shown = [f"{lab} on {d}" + (f" at speed {v:g}" if speeds else "")
             for lab, d, v in zip(labels, devices, speeds or devices)]
    print(f"\ndigits demo: test accuracy {acc:.4f} after {args.epochs} epochs; {sps:.0f} samples/s; "
          f"mode {ctx.comm.mode}; {nw} workers ({', '.join(shown)})")
    print(format_table(rows, labels, devices, speeds))
    if nw > 1 and spread == spread:
        print(f"compute spread per step (slowest / fastest worker, median after step 16): {spread:.3f}")
    ranks = {lab: {**r, "device": d} for lab, r, d in zip(labels, rows, devices)}
    check = check_plan(rows, labels, clock.times, writer)
    path = write_summary(run_dir, {"prediction": check, "model": model_facts(model, acts),
                                   "global_batch": args.global_batch, "accuracy": acc, "samples_per_s": sps, "epochs": args.epochs,
                                   "mode": ctx.comm.mode, "balance": args.balance,
                                   "compute_spread": spread if spread == spread else None,
                                   "final_shares": [int(v) for v in loader.sizes], "ranks": ranks})
    print(f"summary: {path}; TensorBoard: tensorboard --logdir {os.path.join(run_dir, 'tb')}")
    writer.add_scalar("summary/samples_per_s", sps, 0)
    writer.close()


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # slow imports and data loading before joining the job: once it has joined, the
    # summation servers wait for this worker's first step no longer than the peer timeout
    xtr, ytr, xte, yte = load_digits_split()
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    ctx = hetrain.init()
    rank = hetrain.rank()
    run_dir = ctx.env.run_dir if ctx.env else "runs/single"
    machine = ctx.topology.proc(rank).machine if ctx.topology else None
    device = hetrain.device()  # this worker's GPU where the cluster file says cuda: true, else the CPU
    emulated = (EmulatedDevice(machine.device, machine.name, run_dir, cost_per_sample=args.cost_per_sample or None)
                if machine else None)

    model = make_model()
    model.to(device)
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                       named_parameters=model.named_parameters())
    writer = None
    if rank == 0:
        writer = SummaryWriter(os.path.join(run_dir, "tb"))
    steplog = StepLogger(ctx, run_dir, writer)
    # this worker's share of every global batch, on its device; shares follow the measured
    # step times (synchronous training) and are capped by the device's measured free memory
    loader = BalancedLoader(TensorDataset(xtr, ytr), args.global_batch, optimizer=opt, model=model, device=device,
                            balance=args.balance, logger=steplog, seed=1)
    xte, yte = xte.to(device), yte.to(device)
    # model, optimizer and data position continue from the last commit after a restart
    # (hetrain launch --max-restarts); rank 0's initial weights otherwise. A restarted
    # round balances afresh for its own (possibly fewer) workers.
    state = hetrain.elastic.State(model=model, optimizer=opt, loader=loader)
    counts = {"samples": 0, "steps": 0}
    clock, acts = StepClock(), ActivationMeter(model)  # measured step time and memory, against a plan's prediction
    limit = profile_steps()  # `hetrain launch --auto`'s profiling round: a few steps, then plan

    @hetrain.elastic.run
    def train(state) -> None:
        done = loader.epoch + (loader.step >= len(loader))  # epochs finished before this round
        bar = tqdm(total=args.epochs, initial=min(done, args.epochs), desc="epochs", file=sys.stdout,
                   disable=rank != 0, ascii=True, mininterval=0)
        for epoch in loader.epochs(args.epochs):
            for x, y in loader:
                opt.zero_grad()
                loss = None
                if emulated is not None:
                    emulated.check_memory(len(x), loader.balancer.cfg.memory_per_sample,
                                          loader.balancer.cfg.reserved_bytes)
                with emulated.compute(len(x)) if emulated is not None else nullcontext(), acts.of(len(x)):
                    if len(x):
                        loss = F.cross_entropy(model(x), y)
                        loss.backward()
                opt.step()
                clock.tick()
                counts["samples"] += len(x)
                counts["steps"] += 1
                step = epoch * len(loader) + loader.step
                if writer is not None and loss is not None:
                    writer.add_scalar("train/loss", loss.item(), step)
                if args.commit_every and loader.step % args.commit_every == 0:
                    state.commit()  # after opt.step(): a restart resumes with the next step
                if limit and counts["steps"] >= limit:
                    break
            if limit and counts["steps"] >= limit:
                break  # the planned round continues from this round's last commit
            acc = accuracy(model, xte, yte)
            if rank == 0:
                bar.update(1)
                bar.set_postfix(test_acc=f"{acc:.3f}")
                writer.add_scalar("test/accuracy", acc, epoch)
        bar.close()
        loader.finish()  # the last step's exchange: measured, logged and counted like the others
        if args.commit_every:
            state.commit()  # the finished job: a restart from here trains no more

    t_start = time.perf_counter()
    train(state)
    samples, step = counts["samples"], counts["steps"]
    wall = time.perf_counter() - t_start
    st = hetrain.engine().stats
    me = rank if len(steplog.labels) > 1 else 0
    mine = {"samples": samples, "steps": step, "wall_s": wall, "compute_s": steplog.totals["compute_s"][me],
            "comm_s": st.comm_s, "wait_s": st.wait_s, "hidden_s": st.hidden_s,
            "bytes": st.bytes_sent + st.bytes_received, "step_s": clock.median(), "memory": state_bytes(model, opt) + acts.peak()}
    rows = gather_stats(ctx, mine)
    if rank == 0:
        _report(args, ctx, model, xte, yte, rows, wall, loader, steplog, clock, acts, writer, run_dir)
    steplog.close()
    hetrain.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
