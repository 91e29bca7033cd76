"""Each worker says which Ray node (raylet) runs it and checks one summed tensor;
with --steps N it keeps summing (so a node can be removed mid-job)."""
import argparse
import os
import time

import torch

import hetrain

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=1)
ap.add_argument("--sleep", type=float, default=0.0)
args = ap.parse_args()
hetrain.init()
r, n = hetrain.rank(), hetrain.size()
for step in range(args.steps):
    t = torch.full((1000,), float(r + 1))
    hetrain.push_pull([("t", t)], average=False)
    assert t[0].item() == n * (n + 1) / 2, t[0].item()
    if step == 0:
        print(f"probe rank {r} of {n} raylet {os.environ.get('RAY_RAYLET_PID')} sum ok", flush=True)
    if step == 1:
        print(f"probe rank {r} step 1 done", flush=True)
    time.sleep(args.sleep)
hetrain.shutdown()
print(f"probe rank {r} finished", flush=True)
