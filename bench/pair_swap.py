"""Two workers summing a bucket: gloo's all-reduce against hetrain's swap (`p2p.Swap`: each
sends its whole buffer and adds what it receives), side by side.

Two workers of an all-reduce job, each pinned to a core of its own (`threads: 1`), launched
by `hetrain launch` (gloo's socket threads yield as in training, runtime/commthreads.py).
Per size and iteration: a barrier, matrix products (worker 1 computes 1 ms longer, so it
arrives last, as after an uneven backward), then the sum, timed on worker 1: the time a
step waits for its sum after the last worker is done. The two methods take turns every
iteration (A B B A), so a host whose speed drifts slows both alike; the table gives the
median over launches of each launch's median.

    python bench/pair_swap.py [--quick] [--json out.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pinned_pair

SIZES = (1024, 66000, 101706, 262144)  # floats: 4 KB, the bench CNN's and transformer's gradients, 1 MiB
METHODS = ("allreduce", "swap")


def worker(out: str, repeats: int) -> None:
    """Runs in each launched worker: times both methods, worker 1 writes them."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import hetrain
    from hetrain.comm import p2p

    ctx = hetrain.init()
    group, me = ctx.worker_group, hetrain.rank()
    def allreduce(x, _scratch):
        dist.all_reduce(x, group=group)

    def swap(x, scratch):
        p2p.Swap(x, scratch, 1 - me, p2p.PAIR(0), group, "bench swap").wait()

    rows = []
    for n in SIZES:
        x, scratch = torch.ones(n), torch.empty(n)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for i in range(repeats + 4):
            for name in (METHODS if i % 2 == 0 else METHODS[::-1]):
                x.fill_(1.0)
                dist.barrier(group=group)
                pinned_pair.busy(10 + me)
                t = time.perf_counter()
                (allreduce if name == "allreduce" else swap)(x, scratch)
                times[name].append(time.perf_counter() - t)
                if not torch.all(x == 2.0):
                    raise SystemExit(f"{name}: the sum of ones over 2 workers is not 2")
        rows.append({"floats": n, **{f"{m}_s": float(np.median(times[m][4:])) for m in METHODS}})
    if me == 1:
        Path(out).write_text(json.dumps({"rows": rows}))
    hetrain.shutdown()


def main() -> int:
    a = pinned_pair.start(__doc__, "2 launches, 30 sums per size and method (~1 min)", worker, "bench/pair_swap.py")
    if isinstance(a, int):
        return a
    launches, repeats = (2, 30) if a.quick else (4, 80)
    runs = pinned_pair.launches(__file__, launches, repeats, {"run": ()})["run"]
    table = []
    for i, n in enumerate(SIZES):
        row = {"bytes": 4 * n, **{f"{m}_s": statistics.median(r["rows"][i][f"{m}_s"] for r in runs) for m in METHODS}}
        row["allreduce_over_swap"] = row["allreduce_s"] / row["swap_s"]
        table.append(row)
    out = {"rows": table, "launches": launches, "repeats": repeats, "cores": os.cpu_count()}
    print(f"== sum of a bucket over 2 workers pinned to a core each, after the later one's compute "
          f"({launches} launches, medians of {repeats}) ==")
    print(f"{'bytes':>10}{'gloo all-reduce (ms)':>22}{'swap (ms)':>11}{'all-reduce/swap':>17}")
    for r in table:
        print(f"{r['bytes']:>10}{1e3 * r['allreduce_s']:>22.3f}{1e3 * r['swap_s']:>11.3f}{r['allreduce_over_swap']:>17.2f}")
    pinned_pair.write(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
