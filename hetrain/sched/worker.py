"""A small elastic data-parallel training job for the scheduler's real executor.

Run it with `hetrain launch --mode allreduce -m hetrain.sched.worker ...` (one worker
machine per emulated GPU), or alone as a one-rank job. It trains a small MLP with SGD + momentum on a synthetic,
seeded data set, with a sample order that depends only on the global step (never on
the world size): step s uses the global batch perm_e[o : o+B] of epoch e's
permutation, and rank r takes every W-th sample of it. Each rank sums its samples'
losses divided by B and push_pull sums the gradients (average=False), so every step applies
the mean gradient of the same global batch whatever W is: a job stopped and resumed at
another size ends with the parameters of an uninterrupted run (up to float rounding).

SIGUSR1 (or SIGTERM) asks the job to stop: ranks agree (all-reduce MAX of the flag)
after the current step, rank 0 writes the checkpoint atomically
(hetrain.train.checkpoint) and every rank exits with EXIT_STOPPED. On completion the final checkpoint is written with
`done: True` and the processes exit 0. T_compute is emulated: after each step a rank
sleeps compute_s / W (a GPU's share of the global batch's compute).

Rank 0 reports progress in `progress` (step, time, world size, then the steps timed in
this run after its first, with their compute and communication seconds): the scheduler
fits the job's ring curve to them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from hetrain.train.elastic import EXIT_STOPPED, on_stop_request


def build(seed: int, n_samples: int, dim: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n_samples, 1, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    return x, y, model


def global_batch(step: int, batch: int, n_samples: int, seed: int):
    """Sample indices of global step `step`: independent of the world size."""
    import torch

    per_epoch = n_samples // batch
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return perm[k * batch:(k + 1) * batch]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--steps", type=int, required=True, help="total global steps of the job")
    ap.add_argument("--batch", type=int, default=32, help="global batch (samples per step)")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compute-s", type=float, default=0.0, help="emulated compute of one global batch, seconds")
    stop = on_stop_request()  # first thing: a request that arrives while torch imports is kept
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    import hetrain
    from hetrain.train.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    ctx = hetrain.init()
    rank, world = hetrain.rank(), hetrain.size()
    if args.batch % world:
        print(f"worker: global batch {args.batch} is not divisible by world size {world}", file=sys.stderr)
        return 2
    job_dir = Path(args.job_dir)
    ckpt = job_dir / "checkpoint.pt"
    x, y, model = build(args.seed, args.samples, args.dim)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    state = load_checkpoint(ckpt)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
    t_start = time.time()
    times = []
    compute_sum = comm_sum = 0.0  # this run's steps after its first (which includes warm-up)
    code = 0
    while step < args.steps:
        t0 = time.perf_counter()
        idx = global_batch(step, args.batch, args.samples, args.seed)[rank::world]
        opt.zero_grad(set_to_none=False)
        loss = ((model(x[idx]) - y[idx]) ** 2).sum() / args.batch
        loss.backward()
        t1 = time.perf_counter()
        hetrain.push_pull([(n, p.grad) for n, p in model.named_parameters()], average=False)
        t2 = time.perf_counter()
        opt.step()
        if args.compute_s > 0:
            time.sleep(args.compute_s / world)
        step += 1
        t3 = time.perf_counter()
        flag = torch.tensor([1.0 if stop.is_set() else 0.0])
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.worker_group)
        t4 = time.perf_counter()
        times.append(t4 - t0)
        if rank == 0:
            if len(times) > 1:
                compute_sum += (t1 - t0) + (t3 - t2)
                comm_sum += (t2 - t1) + (t4 - t3)
            # step, time, world size, timed steps, their compute and communication seconds
            tmp = job_dir / "progress.tmp"
            tmp.write_text(f"{step} {time.time():.6f} {world} {len(times) - 1} {compute_sum:.6f} {comm_sum:.6f}\n")
            os.replace(tmp, job_dir / "progress")  # readers never see a half-written file
        if flag.item() > 0 and step < args.steps:
            code = EXIT_STOPPED
            break
    # the loop is over: a later stop request has nothing to stop, and must not kill this rank
    # while Python shuts down (which restores SIGUSR1's default action, terminate)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if rank == 0:
        save_checkpoint(ckpt, {"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                               "done": step >= args.steps})
        with (job_dir / "stats.jsonl").open("a") as fh:
            fh.write(json.dumps({"world": world, "steps": len(times), "start": t_start,
                                 "mean_step_s": sum(times[1:]) / max(1, len(times) - 1) if len(times) > 1
                                 else (times[0] if times else None)}) + "\n")
    if world > 1:
        dist.barrier(group=ctx.worker_group)
    hetrain.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
