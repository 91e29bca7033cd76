"""Link and device emulation seen from inside a job: push_pull a known number of bytes
through the rate-limited uplink and time it; run compute on the emulated device; save
what each worker recorded."""
import sys
import time
from pathlib import Path

import torch

import hetrain
from hetrain.cluster.device import EmulatedDevice

out = Path(sys.argv[1])
steps, numel = int(sys.argv[2]), int(sys.argv[3])
ctx = hetrain.init()
rank = hetrain.rank()
t = torch.ones(numel)
hetrain.push_pull([("g", t)])  # layout exchange and connections, outside the timing
before = ctx.bucket.consumed
t0 = time.perf_counter()
for _ in range(steps):
    hetrain.push_pull([("g", t)])
elapsed = time.perf_counter() - t0

machine = ctx.topology.proc(rank).machine
device = EmulatedDevice(machine.device, machine.name)  # stretches real compute by 1/speed
a = torch.randn(200, 200)
walls = []
for _ in range(5):
    w0 = time.perf_counter()
    with device.compute():
        for _ in range(20):
            a = torch.tanh(a @ a.T / 200)
    walls.append(time.perf_counter() - w0)
out.mkdir(parents=True, exist_ok=True)
torch.save({"consumed": ctx.bucket.consumed - before, "rate": ctx.bucket.rate, "burst": ctx.bucket.burst,
            "elapsed": elapsed, "speed": device.last_speed, "real_s": device.real_s, "slept_s": device.slept_s,
            "wall_s": sum(walls)}, out / f"rank{rank}.pt")
hetrain.shutdown()
