"""Counts the Python calls that a DistributedOptimizer's training steps make into the
engine's worker side, run by `hetrain launch` (tests/test_engine_entries.py reads what
each worker writes).

Two models are trained, with and without overlap: one of few parameter tensors and one
of many more small ones, with the same all-reduce buckets (or server partitions), so the
difference between their counts, over the difference in tensors, is what one more
gradient costs per step: the calls into the engine and the staging per gradient.

Counted: every call (sys.setprofile) of a function or method defined in comm/engine.py,
comm/worker/, comm/staging/, comm/transports/ or comm/cuda.py, from the step's
zero_grad() to the end of its step(), over steps after the first few (layout agreement
and the first buffers are per job). Comprehensions and generator expressions inside
those functions are parts of them, not entries, and are not counted.
"""
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import hetrain
import hetrain.comm

WARMUP, COUNTED, GB = 3, 4, 24  # a global batch that 2 and 3 workers split evenly
COMM = Path(hetrain.comm.__file__).resolve().parent
ROOMS = (str(COMM / "engine.py"), str(COMM / "cuda.py"),
         *(str(COMM / d) + os.sep for d in ("worker", "staging", "transports")))


def model(blocks: int) -> nn.Sequential:
    """An MLP whose output side fills the first all-reduce bucket (more than 1 MiB of
    gradient) and whose `blocks` small hidden layers add tensors, not buckets."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.ReLU()]
    for _ in range(blocks):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    layers += [nn.Linear(32, 600), nn.ReLU(), nn.Linear(600, 512), nn.ReLU(), nn.Linear(512, 4)]
    return nn.Sequential(*layers)


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(GB * (WARMUP + COUNTED), 8, generator=g), torch.randint(0, 4, (GB * (WARMUP + COUNTED),),
                                                                               generator=g)


def train(blocks: int, overlap: bool, rank: int = 0, n: int = 1, wrap: bool = True) -> tuple[nn.Module, dict]:
    """Train WARMUP + COUNTED steps of SGD on this worker's half of each global batch;
    the model and what the counted steps called."""
    m = model(blocks)
    x, y = data()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if wrap:
        opt = hetrain.DistributedOptimizer(opt, named_parameters=m.named_parameters(), overlap=overlap)
    calls: Counter = Counter()

    def count(frame, event, _arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(ROOMS) and not code.co_name.startswith("<"):
            calls[f"{Path(code.co_filename).relative_to(COMM)}:{code.co_name}"] += 1

    for s in range(WARMUP + COUNTED):
        idx = torch.arange(s * GB, (s + 1) * GB).chunk(n)[rank]
        if s >= WARMUP:
            sys.setprofile(count)
        try:
            opt.zero_grad()
            F.cross_entropy(m(x[idx]), y[idx]).backward()
            opt.step()
        finally:
            sys.setprofile(None)
    eng = getattr(opt, "engine", None)
    parts = len(eng._layout.parts) if eng is not None and eng._layout is not None else 0
    grads = sum(1 for p in m.parameters() if p.requires_grad)
    return m, {"calls": sum(calls.values()), "steps": COUNTED, "grads": grads, "parts": parts,
               "transport": type(eng.transport).__name__ if eng is not None else None,
               "by_function": dict(calls.most_common())}


if __name__ == "__main__":
    hetrain.init()
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    counts, weights = {}, {}
    for overlap in (True, False):
        for name, blocks in (("few", 2), ("many", 18)):
            m, c = train(blocks, overlap, hetrain.rank(), hetrain.size())
            counts[f"overlap={overlap}/{name}"] = c
            weights[f"overlap={overlap}/{name}"] = m.state_dict()
    (out / f"rank{hetrain.rank()}.json").write_text(json.dumps(counts, indent=1))
    torch.save(weights, out / f"rank{hetrain.rank()}.pt")
    hetrain.shutdown()
