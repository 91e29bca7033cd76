"""A training step's compute under `hetrain launch --heap system` and `--heap keep`, side by side.

Two workers of an all-reduce job, each pinned to a core of its own (`threads: 1`), launched
by `hetrain launch` with one heap policy or the other (runtime/launch/heap.py). Each trains
bench/real_worker.py's CNN on its own share of a 512-sample step, as balanced shares for a
fast and a slow worker would cut it (350 and 162 samples), with no exchange, so the table
shows compute alone: forward, backward and the SGD update, both workers computing at once.
Per step: wall time and the minor page faults the kernel counted (`getrusage`). The two
policies take turns launch by launch (A B A B), so a host whose speed drifts slows both
alike; the table gives the median over launches of each launch's median.

    python bench/heap.py [--quick] [--json out.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pinned_pair

SHARES = (350, 162)  # samples a step on worker 0 and worker 1
POLICIES = {"system": ("--heap", "system"), "keep": ("--heap", "keep")}


def worker(out: str, repeats: int) -> None:
    """Runs in each launched worker: `repeats` timed steps after 10 warm-up steps."""
    import resource

    import numpy as np
    import torch
    import torch.nn.functional as F

    import hetrain
    from hetrain.demo.digits import load_digits_split
    from real_worker import make_model

    ctx = hetrain.init()
    me = hetrain.rank()
    x, y = load_digits_split()[:2]
    idx = torch.arange(SHARES[me]) % len(x)
    xb, yb = x[idx], y[idx]
    model = make_model("cnn", 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    times, faults = [], []
    for i in range(repeats + 10):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    mine = torch.tensor([np.median(times[10:]), np.median(faults[10:])], dtype=torch.float64)
    both = [torch.zeros_like(mine) for _ in range(2)]
    torch.distributed.all_gather(both, mine, group=ctx.worker_group)
    if me == 0:
        env = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
        Path(out).write_text(json.dumps([{"step_s": float(b[0]), "faults": float(b[1]), "env": env} for b in both]))
    hetrain.shutdown()


def main() -> int:
    a = pinned_pair.start(__doc__, "2 launches a policy, 40 steps each (~1 min)", worker, "bench/heap.py")
    if isinstance(a, int):
        return a
    launches, repeats = (2, 40) if a.quick else (4, 100)
    runs = pinned_pair.launches(__file__, launches, repeats, POLICIES)
    rows = []
    for rank, share in enumerate(SHARES):
        row = {"worker": rank, "samples": share}
        for p in POLICIES:
            row[f"{p}_step_s"] = statistics.median(r[rank]["step_s"] for r in runs[p])
            row[f"{p}_faults"] = statistics.median(r[rank]["faults"] for r in runs[p])
        row["system_over_keep"] = row["system_step_s"] / row["keep_step_s"]
        rows.append(row)
    out = {"rows": rows, "launches": launches, "repeats": repeats, "cores": os.cpu_count(),
           "env": {p: runs[p][0][0]["env"] for p in POLICIES}}
    print(f"== CNN forward+backward+SGD on 2 workers pinned to a core each, no exchange "
          f"({launches} launches a policy, medians of {repeats} steps) ==")
    print(f"{'worker':>6}{'samples':>8}{'system (ms)':>13}{'faults':>8}{'keep (ms)':>11}{'faults':>8}"
          f"{'system/keep':>13}")
    for r in rows:
        print(f"{r['worker']:>6}{r['samples']:>8}{1e3 * r['system_step_s']:>13.2f}{r['system_faults']:>8.0f}"
              f"{1e3 * r['keep_step_s']:>11.2f}{r['keep_faults']:>8.0f}{r['system_over_keep']:>13.3f}")
    pinned_pair.write(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
