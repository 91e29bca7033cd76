"""What a new local batch size costs: forward+backward per sample on a batch of a size
this process has run before, against a size it sees for the first time, for the models of
`bench/hetero.py --only real` (MLP, CNN, transformer) on this host's CPU.

Kernels built per input shape (oneDNN's convolution primitives on a CPU; cuDNN's
autotuning with `cudnn.benchmark`, torch.compile's recompiles on a GPU) are built again on
the first pass of each new batch size and then cached. Balanced shares re-solved on step
noise move by a few samples, so a balancer that re-splits on every small move pays this
again and again: the reason for `BalanceConfig.hold` (a split is kept unless a new one is
predicted faster by more than a fraction of the step).

Interleaved: each round times a seen size, then a new one, so a host whose speed drifts
slows both alike; medians over the rounds. One thread, as a worker of the real-compute
benchmark has one core.

    python bench/shapes.py --json bench/results/shapes.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_worker import make_model  # noqa: E402  (the benchmark's own models)

MODELS = ("mlp", "cnn", "transformer")


def measure(kind: str, base: int, rounds: int) -> dict:
    """Seconds per sample of forward+backward at `base` samples (seen every round) and at
    `base + 1 + k` in round k (each seen once: a new shape), medians over the rounds."""
    model = make_model(kind, 0)
    x = torch.randn(base + rounds + 1, 64)
    y = torch.randint(0, 10, (len(x),))

    def one(n: int) -> float:
        model.zero_grad()
        t = time.perf_counter()
        F.cross_entropy(model(x[:n]), y[:n]).backward()
        return (time.perf_counter() - t) / n

    for _ in range(3):  # warm-up: the seen size's kernels are built here
        one(base)
    seen, new = [], []
    for k in range(rounds):
        seen.append(one(base))
        new.append(one(base + 1 + k))
    s, n = statistics.median(seen), statistics.median(new)
    return {"seen_us_per_sample": s * 1e6, "new_us_per_sample": n * 1e6, "new_over_seen": n / s,
            "extra_ms_per_new_shape": (n - s) * base * 1e3, "batch": base, "rounds": rounds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=350, help="local batch size (a fast worker's share of 512)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = {"torch": torch.__version__, "threads": 1, "models": {}}
    print(f"{'model':<12}{'seen us/sample':>15}{'new us/sample':>14}{'new/seen':>9}{'extra ms':>9}")
    for kind in MODELS:
        r = out["models"][kind] = measure(kind, a.batch, a.rounds)
        print(f"{kind:<12}{r['seen_us_per_sample']:>15.1f}{r['new_us_per_sample']:>14.1f}"
              f"{r['new_over_seen']:>9.3f}{r['extra_ms_per_new_shape']:>9.2f}")
    print(f"(forward+backward of a {a.batch}-sample batch, 1 thread; new: a batch size not run before; "
          f"medians of {a.rounds} interleaved rounds)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
