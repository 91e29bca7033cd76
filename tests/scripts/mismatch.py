"""Rank 1 pushes a tensor of another shape in step 2."""
import torch

import hetrain

hetrain.init()
r = hetrain.rank()
for step in range(3):
    b = torch.ones(4 if (r == 1 and step == 2) else 3)
    hetrain.push_pull([("a", torch.ones(5)), ("b", b)])
print("unreachable: mismatch not detected", flush=True)
