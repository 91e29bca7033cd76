"""Why the default (goodput) policy was behind Sia on some workloads, and what closed it:
the default and its ablations against the sia peer, lengths unknown to all, on the
workloads of `bench/sched.py --quick` (the 40-job patterns also at more seeds).

Variants: how unknown lengths are priced (`prior`: as much again as done, at least one
GPU-hour: the rule before; `learned`: the mean residual length under the distribution
learned from finished jobs) x how a move is charged (`once`: the restart cost once;
`hold`: scaled to the time an allocation is expected to hold, HOLD_DECISIONS mean
decision intervals, and Pollux's re-allocation factor), and the hold's length.

    python bench/sched_ablation.py --traces DIR --json out.json [--seeds 3]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetrain.sched.cluster import parse_cluster_spec  # noqa: E402
from hetrain.sched.patterns import make_pattern  # noqa: E402
from hetrain.sched.policies.goodput import HOLD_DECISIONS, goodput_policy  # noqa: E402
from hetrain.sched.simulator import simulate  # noqa: E402
from hetrain.sched.trace import load_trace  # noqa: E402
from traces_workloads import trace_workloads  # noqa: E402

PATTERNS = ["all-at-once", "poisson", "bursts", "poisson-short", "all-at-once-long"]
TRACES = {"23dbec": 40, "6214e9": 100}
VARIANTS = {
    "prior, once (before)": dict(lengths="prior", hold_decisions=None, realloc=False),
    "learned, once": dict(lengths="learned", hold_decisions=None, realloc=False),
    "prior, hold": dict(lengths="prior"),
    f"learned, hold {HOLD_DECISIONS} (default)": {},
    "learned, hold 1": dict(hold_decisions=1),
    "learned, hold 16": dict(hold_decisions=16),
    "learned, once + realloc": dict(hold_decisions=None),
}


def workloads(traces: Path | None, seeds: int):
    three = parse_cluster_spec("v100:8,p100:8,k80:8")
    for pat in PATTERNS:
        for s in range(seeds):
            yield pat, "three-type", s, three, (lambda pat=pat, s=s: make_pattern(pat, 40, three, seed=s))
    for tr, n in TRACES.items():
        yield f"trace:{tr}", "three-type", 0, three, (lambda tr=tr, n=n: load_trace(tr, three, limit=n))
    for name, cname, cluster, makers in trace_workloads(traces, True) if traces else []:
        yield name, cname, 0, cluster, makers[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, help="folder with alibaba-openb-2023/ and philly-runtimes/")
    ap.add_argument("--seeds", type=int, default=1, help="seeds of the 40-job patterns (the traces: one)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    names = list(VARIANTS)
    print("average JCT over sia's (lengths unknown to all; < 1: the variant is ahead)")
    print(f"{'workload':<18}{'cluster':<11}{'seed':>4}{'sia h':>9}" + "".join(f"{n[:22]:>24}" for n in names))
    for w, cname, seed, cluster, make in workloads(args.traces, args.seeds):
        sia = simulate(make(), cluster, "sia").avg_jct_s
        row = {"workload": w, "cluster": cname, "seed": seed, "sia_avg_jct_s": sia, "over_sia": {}}
        for n in names:
            res = simulate(make(), cluster, goodput_policy(**VARIANTS[n]))
            row["over_sia"][n] = res.avg_jct_s / sia
        rows.append(row)
        print(f"{w:<18}{cname:<11}{seed:>4}{sia / 3600:>9.3f}" + "".join(f"{row['over_sia'][n]:>24.4f}" for n in names),
              flush=True)
    seed0 = [r for r in rows if r["seed"] == 0]
    summary = {n: {"worst_seed0": max(r["over_sia"][n] for r in seed0),
                   "behind_sia_seed0": sum(r["over_sia"][n] > 1 for r in seed0),
                   "geomean_all": float(np.exp(np.mean([np.log(r["over_sia"][n]) for r in rows])))} for n in names}
    print(f"\n{'variant':<30}{'worst (seed 0)':>16}{'behind sia':>12}{'geomean, all':>14}")
    for n, v in summary.items():
        print(f"{n:<30}{v['worst_seed0']:>16.4f}{v['behind_sia_seed0']:>12}{v['geomean_all']:>14.4f}")
    print(f"{len(rows)} workloads x {len(names) + 1} policies in {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"variants": VARIANTS, "rows": rows, "summary": summary}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
