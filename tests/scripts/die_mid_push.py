"""Rank 1 is killed (SIGKILL) in the middle of a push_pull of many partitions (from a
timer thread, a few milliseconds into its fourth step), so its server is waiting for
one of its partitions; the others must stop and name it."""
import os
import signal
import threading

import torch

import hetrain

hetrain.init()
r = hetrain.rank()
t = torch.ones(4_000_000)  # 16 MB in 64 KB partitions: the step is mostly partitions in flight


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


for step in range(1000):
    if r == 1 and step == 3:
        threading.Timer(0.005, die).start()
    hetrain.push_pull([("t", t)])
print("unreachable: survived a dead peer", flush=True)
