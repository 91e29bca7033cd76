"""Rank 1 raises an ordinary exception after two steps, while the others wait for it in
push_pull; it must leave at once (no last barrier) so the job ends and names it."""
import torch

import hetrain

hetrain.init()
r = hetrain.rank()
t = torch.ones(50_000)
for step in range(1000):
    if r == 1 and step == 2:
        raise ValueError("bad batch on rank 1")
    hetrain.push_pull([("t", t)])
print("unreachable: survived a failed peer", flush=True)
