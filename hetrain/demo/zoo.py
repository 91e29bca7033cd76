"""Train a model of the zoo (`hetrain.models`) data-parallel on synthetic data: what
`hetrain launch --plan` runs for a plan made for a zoo model, and what bench/plan.py
measures plans with. Inputs are the model's own example inputs (a fixed synthetic set),
labels random; the point is the step time and memory of the plan, not accuracy.

On emulated devices with `--cost-per-sample` a step of b samples takes b·cost/speed
seconds (the calibrated device model of `hetrain.cluster.device`); the real compute runs
underneath and counts toward that time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

import torch
from torch.utils.data import TensorDataset

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.models import ZOO, build_model
from hetrain.train.loader import BalancedLoader
from hetrain.train.metrics import StepLogger
from hetrain.train.summary import (SKIP_STEPS, ActivationMeter, StepClock, check_plan, format_table, gather_stats,
                                   model_facts, profile_steps, state_bytes, write_summary)


def synthetic(model, n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    inputs = model.example_inputs(n, generator=g)
    with torch.no_grad():
        width = model(*(t[:1] for t in inputs)).shape[-1]
    labels = torch.randint(0, max(2, width), (n,), generator=g)
    return TensorDataset(*inputs, labels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(ZOO))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=1024, help="synthetic samples per epoch")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--cost-per-sample", type=float, default=0.0,
                    help="emulated compute: seconds per sample at speed 1 (0: real compute)")
    ap.add_argument("--balance", choices=["measured", "equal"], default="measured")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="first steps left out of the measured step time (default: the summary's; a benchmark "
                         "of the steady state skips the steps the balancer needs to settle)")
    args = ap.parse_args(argv)
    if args.warmup_steps is not None and args.warmup_steps < 0:
        ap.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model)
    data = synthetic(model, args.samples)
    ctx = hetrain.init()
    rank = hetrain.rank()
    run_dir = ctx.env.run_dir if ctx.env else "runs/single"
    machine = ctx.topology.proc(rank).machine if ctx.topology else None
    emulated = (EmulatedDevice(machine.device, machine.name, run_dir, cost_per_sample=args.cost_per_sample or None)
                if machine else None)
    device = hetrain.device()
    model.to(device).train()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                       named_parameters=model.named_parameters())
    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(run_dir, "tb"))
    steplog = StepLogger(ctx, run_dir, writer)
    probe = ActivationMeter(model)  # bytes one sample keeps for backward: what caps a share by memory
    with probe:
        model(*(t[:1].to(device) for t in data.tensors[:-1]))
    loader = BalancedLoader(data, args.global_batch, optimizer=opt, memory_per_sample=float(probe.peak()),
                            device=device, balance=args.balance, logger=steplog, seed=1)
    clock, acts = StepClock(), ActivationMeter(model)
    samples = steps = 0
    limit = profile_steps()  # `hetrain launch --auto`'s profiling round: a few steps, then plan
    t0 = time.perf_counter()
    for _epoch in loader.epochs(args.epochs):
        if limit and steps >= limit:
            break
        for *xs, y in loader:
            if limit and steps >= limit:
                break
            opt.zero_grad()
            with emulated.compute(len(y)) if emulated is not None else nullcontext(), acts.of(len(y)):
                if len(y):
                    model.loss(model(*xs), y).backward()
            opt.step()
            clock.tick()
            samples, steps = samples + len(y), steps + 1
    loader.finish()
    wall = time.perf_counter() - t0
    st = hetrain.engine().stats
    skip = SKIP_STEPS if args.warmup_steps is None else args.warmup_steps
    step_s = clock.median(skip)
    me = rank if len(steplog.labels) > 1 else 0
    rows = gather_stats(ctx, {"samples": samples, "steps": steps, "wall_s": wall,
                              "compute_s": steplog.totals["compute_s"][me], "comm_s": st.comm_s, "wait_s": st.wait_s,
                              "bytes": st.bytes_sent + st.bytes_received, "step_s": step_s,
                              "memory": state_bytes(model, opt) + acts.peak(skip)})
    if rank == 0:
        labels = list(ctx.topology.worker_labels) if ctx.topology else ["w0"]
        print(format_table(rows, labels))
        check = check_plan(rows, labels, clock.times, writer)
        write_summary(run_dir, {"model_name": args.model, "model": model_facts(model, acts, skip),
                                "global_batch": args.global_batch, "mode": ctx.comm.mode, "balance": args.balance,
                                "samples_per_s": sum(r["samples"] for r in rows) / wall, "step_s": rows[0]["step_s"],
                                "prediction": check, "ranks": dict(zip(labels, rows))})
        writer.close()
    steplog.close()
    hetrain.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
