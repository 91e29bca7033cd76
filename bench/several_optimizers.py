"""A GAN's two optimizers under hetrain and under PyTorch DDP, side by side: what a step
with two exchanges of different tensors costs.

Two workers of an all-reduce job, each pinned to a core of its own (`threads: 1`),
launched by `hetrain launch`. Each iteration is a discriminator step, then a generator
step whose loss backpropagates through the discriminator (MLPs of width 1024, about 4.5 MB
of gradients each, batch 64 per worker). hetrain: a DistributedOptimizer per network (its
default overlap; the discriminator's gradients of the generator step are not exchanged,
since no discriminator step follows them). DDP: each network wrapped in its own
DistributedDataParallel, the generator step under the discriminator's `no_sync()` (DDP's
way of not reducing them). In every launch the two systems take turns (A B B A per
repeat, fresh models each), so a host whose speed drifts slows both alike; the table gives
the median over launches of each launch's median iteration time, and how many layouts
hetrain's engine built (comm/known.py keeps each one, so two optimizers build two, plus
retunes of their buckets).

    python bench/several_optimizers.py [--quick] [--json out.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pinned_pair

WIDTH, BATCH, WARM = 1024, 64, 10
SYSTEMS = ("hetrain", "ddp")


def _nets():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 64))
    d = nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
    return g, d


def _run(system: str, steps: int, ctx) -> list[float]:
    """`steps` GAN iterations of `system`; each one's seconds."""
    import torch
    import torch.nn.functional as F
    from contextlib import nullcontext
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetrain

    g, d = _nets()
    og, od = torch.optim.Adam(g.parameters(), 2e-4), torch.optim.Adam(d.parameters(), 2e-4)
    if system == "hetrain":
        og = hetrain.DistributedOptimizer(og, named_parameters=[("g." + n, p) for n, p in g.named_parameters()])
        od = hetrain.DistributedOptimizer(od, named_parameters=[("d." + n, p) for n, p in d.named_parameters()])
        quiet = nullcontext
    else:
        g, d = DDP(g, process_group=ctx.worker_group), DDP(d, process_group=ctx.worker_group)
        quiet = d.no_sync
    gen = torch.Generator().manual_seed(1 + hetrain.rank())
    times = []
    for _ in range(steps):
        real, z = torch.randn(BATCH, 64, generator=gen), torch.randn(BATCH, 64, generator=gen)
        t = time.perf_counter()
        od.zero_grad()
        (F.softplus(-d(real)).mean() + F.softplus(d(g(z).detach())).mean()).backward()
        od.step()
        og.zero_grad()
        with quiet():
            F.softplus(-d(g(z))).mean().backward()
        og.step()
        times.append(time.perf_counter() - t)
    return times


def worker(out: str, repeats: int) -> None:
    """Runs in each launched worker: the systems in turns, rank 0 writes the times."""
    import hetrain
    from hetrain.comm import engine

    built = [0]
    build = engine.PushPull._build_layout

    def counted(self, manifest):
        built[0] += 1
        return build(self, manifest)

    engine.PushPull._build_layout = counted  # counts the layouts hetrain's engine derives
    ctx = hetrain.init()
    steps = WARM + 40
    res: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for k in range(repeats):
        for system in (SYSTEMS + SYSTEMS[::-1]) if k % 2 == 0 else (SYSTEMS[::-1] + SYSTEMS):
            res[system].append(statistics.median(_run(system, steps, ctx)[WARM:]))
    if hetrain.rank() == 0:
        Path(out).write_text(json.dumps({"medians_s": res, "layouts_built": built[0],
                                         "iterations": repeats * 2 * steps}))
    hetrain.shutdown()


def main() -> int:
    a = pinned_pair.start(__doc__, "2 launches, 2 repeats of 40 measured iterations per system (~1 min)", worker,
                          "bench/several_optimizers.py")
    if isinstance(a, int):
        return a
    launches, repeats = (2, 2) if a.quick else (4, 3)
    runs = pinned_pair.launches(__file__, launches, repeats, {"gan": ()})["gan"]
    med = {s: statistics.median(statistics.median(r["medians_s"][s]) for r in runs) for s in SYSTEMS}
    out = {"iteration_s": med, "hetrain_over_ddp_time": med["hetrain"] / med["ddp"],
           "layouts_built": [r["layouts_built"] for r in runs], "hetrain_iterations": [r["iterations"] for r in runs],
           "launches": launches, "repeats": repeats, "cores": os.cpu_count(), "width": WIDTH, "batch": BATCH}
    print(f"== GAN, two optimizers, 2 workers pinned to a core each ({launches} launches, {repeats} repeats x 2 "
          f"turns per system, medians of 40 iterations after {WARM}) ==")
    print(f"{'system':<10}{'ms / iteration':>16}")
    for s in SYSTEMS:
        print(f"{s:<10}{1e3 * med[s]:>16.2f}")
    print(f"hetrain / DDP time {out['hetrain_over_ddp_time']:.3f}; layouts hetrain's engine built per launch "
          f"{out['layouts_built']} in {out['hetrain_iterations'][0]} hetrain iterations (two exchanges each)")
    pinned_pair.write(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
