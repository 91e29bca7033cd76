"""All-reduce time with gloo's socket threads as gloo starts them and lowered to
SCHED_IDLE (`--gloo-thread normal` vs `idle`, runtime/commthreads.py), side by side.

Two workers of an all-reduce job, each pinned to a core of its own (`threads: 1`), launched
by `hetrain launch` (so `init()` applies the policy as in training). Per size, on the
workers' gloo group: the all-reduce right after a barrier, and right after 15 ms of
matrix products on both workers (as after backward). Launches alternate A B A B, so a
host whose speed drifts slows both policies alike; the table gives the median over
launches of each launch's median.

    python bench/gloo_thread.py [--quick] [--json out.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pinned_pair

SIZES = (1024, 32768, 262144, 562000, 2 * 2**20)  # floats: 4 KB to 8 MB (562000: the bench MLP's 2.2 MB)
POLICIES = ("normal", "idle")


def worker(out: str, repeats: int) -> None:
    """Runs in each launched worker: times the all-reduces, rank 0 writes them."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import hetrain
    from hetrain.runtime.commthreads import yielding

    ctx = hetrain.init()
    group = ctx.worker_group
    rows = []
    for n in SIZES:
        x = torch.ones(n)
        row = {"floats": n}
        for case in ("after_barrier", "after_compute"):
            ts = []
            for i in range(repeats + 3):
                dist.barrier(group=group)
                if case == "after_compute":
                    pinned_pair.busy(15)
                t = time.perf_counter()
                dist.all_reduce(x, group=group)
                ts.append(time.perf_counter() - t)
            row[case + "_s"] = float(np.median(ts[3:]))  # the first three warm the connection
        rows.append(row)
    if hetrain.rank() == 0:
        Path(out).write_text(json.dumps({"rows": rows, "yielding": yielding()}))
    hetrain.shutdown()


def main() -> int:
    a = pinned_pair.start(__doc__, "2 launches per policy, 30 all-reduces per size (~1 min)", worker, "bench/gloo_thread.py")
    if isinstance(a, int):
        return a
    launches, repeats = (2, 30) if a.quick else (4, 60)
    runs = pinned_pair.launches(__file__, launches, repeats, {p: ("--gloo-thread", p) for p in POLICIES})
    table = []
    for i, n in enumerate(SIZES):
        row = {"bytes": 4 * n}
        for policy in POLICIES:
            for case in ("after_barrier", "after_compute"):
                row[f"{policy}_{case}_s"] = statistics.median(r["rows"][i][case + "_s"] for r in runs[policy])
        for case in ("after_barrier", "after_compute"):
            row[f"{case}_normal_over_idle"] = row[f"normal_{case}_s"] / row[f"idle_{case}_s"]
        table.append(row)
    out = {"rows": table, "launches": launches, "repeats": repeats, "cores": os.cpu_count(),
           "yielding": {p: [r["yielding"] for r in runs[p]] for p in POLICIES}}
    print(f"== gloo all-reduce, 2 workers pinned to a core each ({launches} launches per policy, A B A B; "
          f"medians of {repeats}) ==")
    print(f"{'bytes':>10} | {'after a barrier (ms)':^28} | {'after 15 ms of compute (ms)':^28}")
    print(f"{'':>10} | {'normal':>8}{'idle':>8}{'normal/idle':>12} | {'normal':>8}{'idle':>8}{'normal/idle':>12}")
    for r in table:
        print(f"{r['bytes']:>10} | {1e3 * r['normal_after_barrier_s']:>8.3f}{1e3 * r['idle_after_barrier_s']:>8.3f}"
              f"{r['after_barrier_normal_over_idle']:>12.2f} | {1e3 * r['normal_after_compute_s']:>8.3f}"
              f"{1e3 * r['idle_after_compute_s']:>8.3f}{r['after_compute_normal_over_idle']:>12.2f}")
    print(f"socket threads lowered: normal {out['yielding']['normal']}, idle {out['yielding']['idle']}")
    pinned_pair.write(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
