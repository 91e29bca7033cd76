"""push_pull known tensors through a lossy codec for several steps; every worker saves
what it got back, and the exact weighted averages, for the test to compare."""
import sys
from pathlib import Path

import torch

import hetrain

out = Path(sys.argv[1])
steps = int(sys.argv[2])
cuda = "--cuda" in sys.argv  # push CUDA tensors (codecs encode on the GPU)
ctx = hetrain.init()
rank, n = hetrain.rank(), hetrain.size()
shapes = {"layer0.weight": (40, 30), "layer0.bias": (40,), "layer1.weight": (700,)}
weights = [3 + 2 * r for r in range(n)]
got, want = [], []
for step in range(steps):
    exact = {k: torch.zeros(s) for k, s in shapes.items()}
    mine = None
    for r in range(n):  # every worker can compute everyone's tensors: same seeds
        g = torch.Generator().manual_seed(1000 * step + r)
        ts = {k: torch.randn(s, generator=g) * (1 + r) for k, s in shapes.items()}
        for k in shapes:
            exact[k] += ts[k] * weights[r] / sum(weights)
        if r == rank:
            mine = ts
    named = [(k, v.to(hetrain.device()) if cuda else v) for k, v in mine.items()]
    hetrain.push_pull(named, batch_size=weights[rank])
    got.append(torch.cat([t.reshape(-1).cpu() for _, t in named]))
    want.append(torch.cat([exact[k].reshape(-1) for k in shapes]))
st = hetrain.engine().stats
out.mkdir(parents=True, exist_ok=True)
torch.save({"got": torch.stack(got), "want": torch.stack(want),
            "bytes": torch.tensor([st.bytes_sent, st.bytes_received])}, out / f"rank{rank}.pt")
hetrain.shutdown()
