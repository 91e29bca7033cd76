"""What one call of the tensor API costs: `hetrain.push_pull(tensor)` (Horovod's
`allreduce`: a new tensor, the average over workers) against what a plain PyTorch
script writes for the same result (`out = t.clone(); dist.all_reduce(out); out /= n`),
at sizes from a scalar (a loss or a metric) to 4 MB; the same call alternating two
tensor lists (a loss and a metric: the engine switches between two kept layouts); and
Horovod's own form, `hetrain.allreduce(tensor)`, which announces each call to workers
that may have joined (`hvd.join()`) before its all-reduce.

Two workers of an all-reduce job, each pinned to a core of its own (`threads: 1`),
launched by `hetrain launch`; the systems take turns (A B B A per repeat), the table gives
the median over launches of each launch's median call time. A training step's gradient
exchange is not this path (it skips the step header; `bench/hetero.py` measures it).

    python bench/push_pull_call.py [--quick] [--json out.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pinned_pair

SIZES = (1, 1_000, 100_000, 1_000_000)  # float32 elements
CALLS, WARM = 200, 20
CASES = ("hetrain", "torch", "hetrain_alternating", "horovod_form")


def _timed(fn, calls: int) -> float:
    for _ in range(WARM):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def worker(out: str, repeats: int) -> None:
    """Runs in each launched worker: every case in turns, rank 0 writes the times."""
    import torch
    import torch.distributed as dist

    import hetrain

    ctx = hetrain.init()
    n = hetrain.size()

    def plain(t):
        o = t.clone()
        dist.all_reduce(o, group=ctx.worker_group)
        return o.div_(n)

    res: dict[str, dict[str, list[float]]] = {str(s): {c: [] for c in CASES} for s in SIZES}
    for size in SIZES:
        x, y = torch.randn(size), torch.randn(size + 1)
        fns = {"hetrain": lambda: hetrain.push_pull(x, name="loss"),
               "torch": lambda: plain(x),
               "horovod_form": lambda: hetrain.allreduce(x, name="loss"),
               "hetrain_alternating": lambda: (hetrain.push_pull(x, name="loss"), hetrain.push_pull(y, name="metric"))}
        for k in range(repeats):
            order = CASES + CASES[::-1] if k % 2 == 0 else CASES[::-1] + CASES
            for case in order:
                per = _timed(fns[case], CALLS // 2 if case == "hetrain_alternating" else CALLS)
                res[str(size)][case].append(per / 2 if case == "hetrain_alternating" else per)
    if hetrain.rank() == 0:
        Path(out).write_text(json.dumps({"call_s": res}))
    hetrain.shutdown()


def main() -> int:
    a = pinned_pair.start(__doc__, "2 launches, 1 repeat per case (~1 min)", worker, "bench/push_pull_call.py")
    if isinstance(a, int):
        return a
    launches, repeats = (2, 1) if a.quick else (4, 2)
    runs = pinned_pair.launches(__file__, launches, repeats, {"calls": ()})["calls"]
    med = {str(s): {c: statistics.median(statistics.median(r["call_s"][str(s)][c]) for r in runs) for c in CASES}
           for s in SIZES}
    out = {"call_s": med, "hetrain_over_torch": {s: m["hetrain"] / m["torch"] for s, m in med.items()},
           "launches": launches, "repeats": repeats, "calls": CALLS, "cores": os.cpu_count()}
    print(f"== one averaging call, 2 workers pinned to a core each ({launches} launches, {repeats} repeats x 2 "
          f"turns per case, medians of {CALLS} calls after {WARM}) ==")
    print(f"{'float32 elements':>17}{'hetrain ms':>12}{'torch ms':>10}{'hetrain/torch':>15}{'alternating ms':>16}"
          f"{'allreduce ms':>14}")
    for s, m in med.items():
        print(f"{int(s):>17,}{1e3 * m['hetrain']:>12.3f}{1e3 * m['torch']:>10.3f}"
              f"{m['hetrain'] / m['torch']:>15.2f}{1e3 * m['hetrain_alternating']:>16.3f}{1e3 * m['horovod_form']:>14.3f}")
    print("hetrain: hetrain.push_pull(t); alternating: two tensors in turn; allreduce: hetrain.allreduce(t)")
    print("torch: out = t.clone(); dist.all_reduce(out); out /= n (no check that the workers' tensors agree)")
    pinned_pair.write(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
