"""Rank 1 is killed (SIGKILL) after two steps; the others must stop and name it."""
import os
import signal

import torch

import hetrain

hetrain.init()
r = hetrain.rank()
t = torch.ones(50_000)
for step in range(1000):
    if r == 1 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    hetrain.push_pull([("t", t)])
print("unreachable: survived a dead peer", flush=True)
