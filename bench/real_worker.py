"""The training process `bench/hetero.py --only real` launches on every worker.

Real compute, no sleeps and no repeated backward: a worker `--slow k` times is emulated by
`k` extra forward passes of its own model (no autograd, real arithmetic on its own batch)
inside every forward, so its per-sample cost rises while backward runs once and gradient
hooks fire once: overlap stays on for hetrain and for PyTorch DDP alike.

Models (digits, 8x8 images, 10 classes): `mlp` (width-512, 4 layers), `cnn` (3 conv layers,
pooled, a linear head), `transformer` (8 tokens of 8 pixels, 2 encoder layers, d=64).

Kinds, run interleaved (`--kinds ddp,even,balanced,...`, every repeat runs each once;
`ddp+even` trains both side by side, alternating their steps):
  ddp        PyTorch DDP, equal shares of the same global batches (its bucketed, overlapped
             all-reduce)
  even       hetrain, equal shares (BalancedLoader balance="equal"), overlap on
  balanced   hetrain, measured shares, unequal local batches, batch-weighted average
  accumulate hetrain, measured counts of equal micro-batches (gradient accumulation)
  ddp-static PyTorch DDP with fixed unequal shares from the last speed measurement (loss
             weighted by share): what static balancing reaches with DDP's own exchange
  tail       balanced, with the end of every step claimed while it runs (`--tail`, `--tail-chunks`)
Rank 0 writes per-step wall times, shares, per-phase times and accuracies as JSON.
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
from hetrain.demo.digits import load_digits_split
from hetrain.train.balance import BalanceConfig
from hetrain.train.loader import BalancedLoader
from hetrain.train.sampler import GlobalBatchSampler


class Tokens(nn.Module):
    """Digits as 8 tokens of 8 pixels, a small pre-norm transformer encoder, mean-pooled."""

    def __init__(self, d: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.zeros(8, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.embed(x.view(-1, 8, 8)) + self.pos
        return self.head(self.encoder(h).mean(1))


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        w = 512
        return nn.Sequential(nn.Linear(64, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                             nn.Linear(w, 10))
    if kind == "cnn":
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 16, 10))
    if kind == "transformer":
        return Tokens()
    raise SystemExit(f"unknown model {kind!r}: mlp, cnn or transformer")


class Slowed(nn.Module):
    """`inner` with `extra` additional no-grad forward passes per call: a slower device in
    real compute (per-sample cost grows, backward runs once)."""

    def __init__(self, inner: nn.Module, extra: int):
        super().__init__()
        self.inner = inner
        self.extra = extra

    def forward(self, x):
        if self.extra and len(x):
            with torch.no_grad():
                for _ in range(self.extra):
                    self.inner(x)
        return self.inner(x)


def acc_of(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def _ddp_batches(sampler, xtr, ytr, rank):
    epoch = 0
    while True:
        for s in range(sampler.steps_per_epoch()):
            idx = torch.from_numpy(sampler.indices(epoch, s, rank))
            yield xtr[idx], ytr[idx]
        epoch += 1


def _fixed_batches(sampler, xtr, ytr, rank, shares):
    """DDP's batches with fixed unequal shares: each global batch cut in the shares' proportions."""
    epoch = 0
    while True:
        for s in range(sampler.steps_per_epoch()):
            idx = torch.from_numpy(sampler.split(sampler.global_batch_at(epoch, s), shares)[rank])
            yield xtr[idx], ytr[idx]
        epoch += 1


def balanced_finish(fixed: np.ndarray, slope: np.ndarray, gb: int) -> tuple[float, np.ndarray]:
    """When workers taking fixed + slope x samples finish together on `gb` samples: T with
    Σ (T - fixed_i) / slope_i = B over the workers that take part (a worker whose fixed
    part alone exceeds T sits out), and which take part."""
    active = np.ones(len(fixed), dtype=bool)
    while True:
        t = (gb + np.sum(fixed[active] / slope[active])) / np.sum(1 / slope[active])
        drop = active & (fixed >= t)
        if not drop.any():
            return float(t), active
        active &= ~drop


def fixed_shares(speed: dict, gb: int) -> list[int]:
    """Shares that equalize fixed + slope x b across the workers (the measured speeds), the
    finish the ideal assumes (a worker that would sit out keeps 1 sample: DDP needs every
    rank in its all-reduce)."""
    fixed, slope = np.asarray(speed["fixed_s"]), np.asarray(speed["slope_s"])
    t, _ = balanced_finish(fixed, slope, gb)
    raw = np.maximum(1.0, (t - fixed) / slope)
    shares = np.floor(raw * gb / raw.sum()).astype(int)
    shares[np.argmax(raw - shares)] += gb - shares.sum()
    return shares.tolist()


LAST_SPEED: dict = {}  # the last speed measurement of this process (kind ddp-static takes its shares from it)


def _hetrain_batches(loader):
    while True:
        yield from loader


def measure_speed(a, net, model, data, rank, nw, ctx) -> dict:
    """This worker's forward+backward time as fixed + per-sample seconds, fitted on three
    batch sizes (half, one and one and a half equal shares: the range balanced shares
    take), all workers computing at once as in training (shared cores are shared here too);
    the median pass per size. The sizes take turns (a round of each), so a host whose speed
    drifts during the measurement moves every size alike rather than tilting the fit. A
    per-sample cost alone would charge a small share the fixed part of a pass (Python,
    kernel launches) it does not shrink by.

    Every worker measures for the same span of time: `speed_steps` times the slowest
    worker's first round (a warm-up, not measured), and a pass that ends after the span is
    dropped. With a count of rounds each instead, a fast worker would finish first and wait,
    and the slow one would time its last rounds on a quieter host than training gives it:
    on this project's 2-core host a worker computes up to 1.5x faster while its neighbour
    idles, so its fit, the ideal and static DDP's shares would be too optimistic."""
    xtr, ytr = data[0], data[1]
    b = a.global_batch // nw
    sizes = [max(1, b // 2), b, b + b // 2]

    def one_pass(n: int) -> tuple[float, float]:
        idx = torch.arange(rank * n, (rank + 1) * n) % len(xtr)
        model.zero_grad()
        t = time.perf_counter()
        F.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
        return t, time.perf_counter()

    t0 = time.perf_counter()
    for n in sizes:
        one_pass(n)
    first = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=ctx.worker_group)  # every worker leaves it together
    deadline = time.perf_counter() + a.speed_steps * float(first)
    times: list[list[float]] = [[] for _ in sizes]
    while time.perf_counter() < deadline:
        for k, n in enumerate(sizes):
            start, end = one_pass(n)
            if end <= deadline:
                times[k].append(end - start)
    if not all(times):
        raise SystemExit(f"speed measurement: rank {rank} finished no pass of some size within the span "
                         f"({a.speed_steps} x {float(first):.3f} s); raise --speed-steps")
    med = [float(np.median(ts)) for ts in times]
    per, fixed = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(med), 1)
    mine = torch.tensor([med[1] / b, max(0.0, float(fixed)), max(1e-12, float(per)), len(times[1])],
                        dtype=torch.float64)
    allp = [torch.zeros_like(mine) for _ in range(nw)]
    dist.all_gather(allp, mine, group=ctx.worker_group)
    return {"kind": "speed", "rep": -1, "per_sample_s": [float(p[0]) for p in allp],
            "fixed_s": [float(p[1]) for p in allp], "slope_s": [float(p[2]) for p in allp],
            "rounds": [int(p[3]) for p in allp], "share": b, "sizes": sizes}


class Runner:
    """One system's training run, a step at a time (so two systems can alternate steps)."""

    def __init__(self, a, kind: str, rep: int, ctx, data):
        self.a, self.kind, self.rep, self.ctx, self.data = a, kind, rep, ctx, data
        rank, nw = hetrain.rank(), hetrain.size()
        xtr, ytr = data[0], data[1]
        extra = int(a.slow.split(",")[rank]) if a.slow else 0
        self.model = make_model(a.model, 100 + rep)
        self.net = Slowed(self.model, extra)
        self.loader = None
        if kind in ("ddp", "ddp-static"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.net, process_group=ctx.worker_group)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=a.lr, momentum=0.9)
            sampler = GlobalBatchSampler(len(xtr), a.global_batch, nw, seed=rep)
            if kind == "ddp":
                self.batches = _ddp_batches(sampler, xtr, ytr, rank)
            else:
                self.shares = fixed_shares(LAST_SPEED, a.global_batch)
                self.batches = _fixed_batches(sampler, xtr, ytr, rank, self.shares)
        else:
            self.opt = hetrain.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=a.lr, momentum=0.9),
                                                    named_parameters=self.model.named_parameters(), overlap=True)
            self.loader = BalancedLoader((xtr, ytr), a.global_batch, optimizer=self.opt, seed=rep, device="cpu",
                                         balance="equal" if kind == "even" else "measured",
                                         strategy="accumulate" if kind == "accumulate" else "unequal",
                                         micro_batch=a.micro_batch, tail=a.tail if kind == "tail" else 0.0,
                                         config=BalanceConfig(tail_chunks=a.tail_chunks))
            self.batches = _hetrain_batches(self.loader)
        self.times, self.phases, self.accs = [], [], []
        self.clock = 0.0  # this system's own training time (other systems' steps and evaluation excluded)
        self.steps = 0

    def step(self) -> None:
        a, kind, nw = self.a, self.kind, hetrain.size()
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = next(self.batches)
        ta = time.perf_counter()
        self.opt.zero_grad()
        loader = self.loader
        micro = loader.micro_batches(x, y) if loader is not None else [(x, y)]
        tf = tb = 0.0
        n = 0  # samples trained on (the tail's claimed chunks included)
        for mx, my in micro:
            n += len(mx)
            t1 = time.perf_counter()
            out = self.net(mx) if len(mx) else None
            t2 = time.perf_counter()
            if out is not None:
                scale = len(mx) / len(x) if not kind.startswith("ddp") else len(mx) * nw / a.global_batch
                (F.cross_entropy(out, my) * scale).backward()
            elif kind.startswith("ddp"):  # DDP needs every rank in the all-reduce
                (sum(p.sum() for p in self.net.parameters()) * 0).backward()
            tf += t2 - t1
            tb += time.perf_counter() - t2
        t3 = time.perf_counter()
        if not kind.startswith("ddp"):
            self.opt.synchronize()
        t35 = time.perf_counter()
        if not kind.startswith("ddp"):
            with self.opt.skip_synchronize():
                self.opt.step()
        else:
            self.opt.step()
        t4 = time.perf_counter()
        self.clock += t4 - t0
        self.times.append(self.clock)
        self.phases.append((t3 - ta - tf - tb, tf, tb, t35 - t3, t4 - t35, n, ta - t0, time.process_time() - c0,
                            t3, t35))
        self.steps += 1
        if a.eval_every and self.steps % a.eval_every == 0:  # evaluation time is not training time
            self.accs.append((self.steps, self.clock, acc_of(self.model, self.data[2], self.data[3])))

    def result(self) -> dict:
        a, nw = self.a, hetrain.size()
        from hetrain.runtime.commthreads import yielding

        out = {"kind": self.kind, "rep": self.rep, "times": self.times, "gloo_threads_yield": yielding(),
               "final_acc": acc_of(self.model, self.data[2], self.data[3]), "accs": self.accs}
        if self.kind == "ddp-static":
            out["sizes"] = [self.shares] * len(self.times)
        if self.loader is not None:
            self.loader.finish()
            out["sizes"] = [[int(v) for v in h] for h in self.loader.balancer.history[:a.steps]]
            out["loader_exchange_s"] = self.loader.batches.exchange_s
        # every rank's phases (before, forward, backward, exchange, update, samples, batch fetch, process CPU
        # seconds: every thread, gloo's included; then the host's monotonic clock at the end of backward and
        # of the exchange, comparable across the workers of one host) per step
        mine = torch.tensor(self.phases, dtype=torch.float64)
        allp = [torch.zeros_like(mine) for _ in range(nw)]
        dist.all_gather(allp, mine, group=self.ctx.worker_group)
        out["phases"] = [p.tolist() for p in allp]
        dist.barrier(group=self.ctx.worker_group)
        return out


def one_run(a, kind: str, rep: int, ctx, data) -> list[dict]:
    """`kind`, or several joined by '+' (e.g. `ddp+even`) trained side by side: their steps
    alternate (ABBA...), so a host whose speed drifts slows each system alike."""
    rank, nw = hetrain.rank(), hetrain.size()
    if kind == "speed":  # this worker's compute alone: forward+backward at an equal share, no exchange
        model = make_model(a.model, 100 + rep)
        extra = int(a.slow.split(",")[rank]) if a.slow else 0
        LAST_SPEED.update(measure_speed(a, Slowed(model, extra), model, data, rank, nw, ctx))
        return [dict(LAST_SPEED)]
    runners = [Runner(a, k, rep, ctx, data) for k in kind.split("+")]
    for step in range(a.steps):
        for r in (runners if step % 2 == 0 else runners[::-1]):
            r.step()
    return [r.result() for r in runners]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--kinds", default="ddp,even,balanced")
    ap.add_argument("--slow", default="", help="extra no-grad forward passes per worker, e.g. 0,3")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--tail", type=float, default=0.2, help="kind tail: the fraction of each step claimed while it runs")
    ap.add_argument("--tail-chunks", type=int, default=3, help="kind tail: chunks each worker expects per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speed-steps", type=int, default=12,
                    help="a speed measurement lasts this many of the slowest worker's rounds of the three sizes")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ctx = hetrain.init()
    data = load_digits_split()
    import os
    if os.environ.get("BENCH_CPROFILE") and hetrain.rank() == 0:  # where the step's Python time goes
        import cProfile
        import pstats
        prof = cProfile.Profile()
        runs = []
        for rep in range(a.repeats):
            for kind in a.kinds.split(","):
                if kind == os.environ.get("BENCH_CPROFILE_KIND", "even") and rep == a.repeats - 1:
                    prof.enable()
                runs += one_run(a, kind, rep, ctx, data)
                prof.disable()
        with open(os.environ["BENCH_CPROFILE"], "w") as fh:
            prof.dump_stats(os.environ["BENCH_CPROFILE"] + ".prof")
            order = os.environ.get("BENCH_CPROFILE_SORT", "tottime")  # or cumulative
            pstats.Stats(prof, stream=fh).sort_stats(order).print_stats(80)
    else:
        runs = [r for rep in range(a.repeats) for kind in a.kinds.split(",") for r in one_run(a, kind, rep, ctx, data)]
    if hetrain.rank() == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"runs": runs, "model": a.model, "slow": a.slow,
                                           "global_batch": a.global_batch, "workers": hetrain.size(),
                                           "threads": torch.get_num_threads()}))
    hetrain.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
