"""A small elastic data-parallel training job for the scheduler's real executor.

Run it with `hetrain launch --mode allreduce -m hetrain.sched.worker ...` (one worker
machine per emulated GPU), or alone as a one-rank job. It trains a small MLP with SGD + momentum on a synthetic,
seeded data set, with a sample order that depends only on the global step (never on
the world size): step s uses the global batch perm_e[o : o+B] of epoch e's
permutation, and rank r takes every W-th sample of it. Each rank sums its samples'
losses divided by B and push_pull sums the gradients (average=False), so every step applies
the mean gradient of the same global batch whatever W is: a job stopped and resumed at
another size ends with the parameters of an uninterrupted run (up to float rounding).
A restart may also change the global batch (`--batch`; the scheduler's goodput policy
picks it): the job keeps its position in the sample stream (`stream_batch`), so it
goes on with exactly the samples an uninterrupted run would see next, and its learning
rate is scaled by `--lr-rule` from the base batch. Its work (`--steps`, base-batch
steps) advances by batch/base x the statistical efficiency at the gradient noise scale
the workers measure from their local and summed gradients (Pollux's progress).

Model, optimizer and step live in a `hetrain.elastic.State` committed under
`<job-dir>/elastic` (read it back with `hetrain.train.elastic.load_committed`).
SIGUSR1 (or SIGTERM) asks the job to stop: after the current step the ranks agree
(`state.check()`: all-reduce MAX of the flag), commit, and every rank exits with
EXIT_STOPPED; a relaunch at any size resumes from that commit. On completion the final
commit carries `done=True` and the processes exit 0. T_compute is emulated: after each
step a rank sleeps compute_s / W (a GPU's share of the global batch's compute).

Rank 0 reports progress in `progress` (step, time, world size, then the steps timed in
this run after its first, with their compute and communication seconds): the scheduler
fits the job's ring curve to them.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from hetrain.atomicfile import atomic_write
from hetrain.train.elastic import EXIT_STOPPED, StopAtCommit, on_stop_request  # noqa: F401 (EXIT_STOPPED: for the executor)


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
    """Sample indices of global step `step` at a fixed batch: independent of the world size."""
    return stream_batch(step * batch, batch, n_samples, seed)


def stream_batch(start: int, batch: int, n_samples: int, seed: int):
    """Samples [start, start + batch) of the job's sample stream: epoch e's seeded
    permutation after epoch e-1's. A job that changes its batch on a restart continues
    from the number of samples it has seen, so every sample is seen in the same order
    whatever the batches and world sizes were."""
    import torch

    pos = torch.arange(start, start + batch)
    epochs = pos // n_samples
    out = torch.empty(batch, dtype=torch.long)
    for e in torch.unique(epochs).tolist():
        perm = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed * 100003 + e))
        sel = epochs == e
        out[sel] = perm[pos[sel] % n_samples]
    return out


def _parser() -> argparse.ArgumentParser:
    """The worker's command line (the executor passes the job's decided batch and emulated compute)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--steps", type=int, required=True,
                    help="the job's work: steps at the base batch (statistical efficiency weighs larger batches)")
    ap.add_argument("--batch", type=int, default=32, help="this run's global batch (samples per step)")
    ap.add_argument("--base-batch", type=int, default=0, help="the batch --steps, --lr and --compute-s are "
                    "given at (default: --batch)")
    ap.add_argument("--lr-rule", choices=["sqrt", "linear"], default="sqrt",
                    help="learning rate at another batch: lr x sqrt(batch/base) (default) or lr x batch/base")
    ap.add_argument("--noise-scale", type=float, default=float("inf"),
                    help="gradient noise scale assumed until the workers have measured it (samples)")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compute-s", type=float, default=0.0, help="emulated compute of one base batch, seconds")
    return ap


def _write_progress(job_dir: Path, line: str) -> None:
    """Replace the job's `progress` file with one line: step, time, world size, timed steps,
    their compute and communication seconds, then the work done (base steps), this run's
    batch and the noise scale (`hetrain.sched.progress.read_progress` parses it). Written
    to a temporary file and renamed, so the executor never reads a half-written one."""
    atomic_write(job_dir / "progress", lambda fh: fh.write((line + "\n").encode()), durable=False)


def _append_stats(job_dir: Path, world: int, times: list[float], t_start: float) -> None:
    """One line per run in `stats.jsonl`: its world size, steps and mean step (first excluded)."""
    with (job_dir / "stats.jsonl").open("a") as fh:
        fh.write(json.dumps({"world": world, "steps": len(times), "start": t_start,
                             "mean_step_s": sum(times[1:]) / max(1, len(times) - 1) if len(times) > 1
                             else (times[0] if times else None)}) + "\n")


def _noise_scale(gns: list[float], assumed: float) -> float:
    """The gradient noise scale from the moving averages `gns` = [|G|^2, variance, weight];
    `assumed` until the workers have measured anything."""
    sqr, var, w = gns
    if w == 0:
        return assumed
    return max(0.0, var / sqr) if sqr > 0 else float("inf")


def _track_noise(gns: list[float], local_sqr: float, global_sqr: float, b_local: int, batch: int) -> list[float]:
    """Fold one step's local and summed gradient square norms into the moving averages."""
    from hetrain.perf.goodput import NoiseSample, gradient_moments

    sqr, var = gradient_moments([NoiseSample(local_sqr, global_sqr, b_local, batch)])
    a = 0.9  # AdaptDL-style moving averages of both moments
    return [a * gns[0] + (1 - a) * float(sqr[0]), a * gns[1] + (1 - a) * float(var[0]), a * gns[2] + (1 - a)]


def main(argv=None) -> int:
    ap = _parser()
    on_stop_request()  # first thing: a request that arrives while torch imports is kept (State uses it)
    args = ap.parse_args(argv)

    import torch

    import hetrain
    from hetrain.perf.goodput import efficiency, scale_lr

    torch.set_num_threads(1)
    hetrain.init()
    rank, world = hetrain.rank(), hetrain.size()
    base = args.base_batch or args.batch
    if args.batch % world:
        print(f"worker: global batch {args.batch} is not divisible by world size {world}", file=sys.stderr)
        return 2
    job_dir = Path(args.job_dir)
    x, y, model = build(args.seed, args.samples, args.dim)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # step: optimizer steps; samples: position in the sample stream; progress: base-batch
    # steps of work done (each step adds batch/base x its statistical efficiency);
    # gns: moving averages of the gradient's square norm and variance (noise scale)
    state = hetrain.elastic.State(model=model, optimizer=opt, step=0, samples=0, progress=0.0,
                                  gns=[0.0, 0.0, 0.0], done=False, directory=job_dir / "elastic", replicas=1)
    t_start = time.time()
    times = []
    compute_sum = comm_sum = 0.0  # this run's steps after its first (which includes warm-up)
    b_local = args.batch // world

    def noise_scale() -> float:
        return _noise_scale(state.gns, args.noise_scale)

    @hetrain.elastic.run
    def train(state) -> None:
        nonlocal compute_sum, comm_sum
        for group in opt.param_groups:  # after a restore: this run's batch sets the rate
            group["lr"] = scale_lr(args.lr, base, args.batch, args.lr_rule)
        while state.progress < args.steps - 1e-9:
            t0 = time.perf_counter()
            idx = stream_batch(state.samples, args.batch, args.samples, args.seed)[rank::world]
            opt.zero_grad(set_to_none=False)
            loss = ((model(x[idx]) - y[idx]) ** 2).sum() / args.batch
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            # this worker's mean gradient is grad x batch / local batch: its square norm,
            # summed over the workers with the gradients, measures the noise scale
            local_sqr = torch.tensor([sum(float((g * (args.batch / b_local)).pow(2).sum()) for g in grads)])
            t1 = time.perf_counter()
            hetrain.push_pull([(n, p.grad) for n, p in model.named_parameters()] + [("gns.local_sqr", local_sqr)],
                              average=False)
            t2 = time.perf_counter()
            if world > 1:  # one worker: local and global gradients are the same, nothing to learn
                state.gns = _track_noise(state.gns, float(local_sqr) / world,
                                         sum(float(g.pow(2).sum()) for g in grads), b_local, args.batch)
            opt.step()
            if args.compute_s > 0:
                time.sleep(args.compute_s * args.batch / base / world)
            state.step += 1
            state.samples += args.batch
            state.progress += args.batch / base * float(efficiency(args.batch, base, noise_scale()))
            t3 = time.perf_counter()
            stopping = None
            if state.progress < args.steps - 1e-9:
                try:
                    state.check()  # a stop request: all ranks commit here and exit EXIT_STOPPED
                except StopAtCommit as stop:
                    stopping = stop  # report this step first
            t4 = time.perf_counter()
            times.append(t4 - t0)
            if rank == 0:
                if len(times) > 1:
                    compute_sum += (t1 - t0) + (t3 - t2)
                    comm_sum += (t2 - t1) + (t4 - t3)
                _write_progress(job_dir, f"{state.step} {time.time():.6f} {world} {len(times) - 1} "
                                f"{compute_sum:.6f} {comm_sum:.6f} {state.progress:.6f} {args.batch} "
                                f"{noise_scale():.6g}")
            if stopping is not None:
                raise stopping
        # the loop is over: a later stop request has nothing to stop, and must not kill this
        # rank while Python shuts down (which restores SIGUSR1's default action, terminate)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        state.done = True
        state.commit()

    code = 0
    try:
        train(state)
    except SystemExit as stopped:  # run() turns an agreed stop into the launcher's exit code
        code = int(stopped.code)
    if rank == 0:
        _append_stats(job_dir, world, times, t_start)
    hetrain.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
