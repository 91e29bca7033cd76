"""Push-pull steps forever, announcing each (a test stops a server meanwhile)."""
import torch

import hetrain

hetrain.init()
t = torch.ones(20_000)
for step in range(100000):
    hetrain.push_pull([("t", t)])
    if hetrain.rank() == 0 and step % 10 == 0:
        print(f"step {step}", flush=True)
