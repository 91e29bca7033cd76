"""Workers push_pull odd-sized fp32 and fp16 tensors for a few steps (unequal batch
weights, one plain sum) and save every result, so a test can compare the job run with
shared memory between workers and co-located servers against gloo; each worker checks
its results against the value computed from every rank's inputs, and says how many
shared-memory channels it used."""
import sys
from pathlib import Path

import torch

import hetrain
from hetrain.comm.shm.select import _PUMPS

hetrain.init()
r, n = hetrain.rank(), hetrain.size()
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
shapes = {"a": ((7,), torch.float32), "b": ((1001, 3), torch.float32), "c": ((333,), torch.float16),
          "d": ((250_003,), torch.float32)}


def value(rank: int, step: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=g).to(dtype)


saved = {}
for step in range(4):
    weights = [k + 2 for k in range(n)]
    average = step != 2
    named = [(name, value(r, step, shape, dt)) for name, (shape, dt) in shapes.items()]
    hetrain.push_pull(named, batch_size=weights[r], average=average)
    for name, got in named:
        shape, dt = shapes[name]
        vals = [value(k, step, shape, dt).double() for k in range(n)]
        want = sum(w * v for w, v in zip(weights, vals)) / sum(weights) if average else sum(vals)
        tol = 2e-2 if dt == torch.float16 else 1e-5
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=f"step {step} tensor {name}")
        saved[f"{step}-{name}"] = got.clone()
torch.save(saved, out / f"rank{r}.pt")
channels = sum(len(p.channels) for p in _PUMPS.values())
print(f"server-link ok on rank {r}: {channels} shared-memory channels", flush=True)
hetrain.shutdown()
