"""Train with parameter servers that hold the parameters (async / bounded staleness) on
a fast and a slow emulated worker; save the largest clock gap each worker saw."""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain
from hetrain.cluster.device import EmulatedDevice

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from reference import data, make_model  # noqa: E402

out = Path(sys.argv[1])
steps = int(sys.argv[2])
ctx = hetrain.init()
rank, n = hetrain.rank(), hetrain.size()
machine = ctx.topology.proc(rank).machine
device = EmulatedDevice(machine.device, machine.name, cost_per_sample=0.002)  # calibrated: stable timing
x, y = data()
model = make_model()
opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters())
losses = []
with torch.no_grad():
    start_full = F.cross_entropy(model(x), y).item()
for step in range(steps):
    idx = torch.arange(step * 8, step * 8 + 8) % 200
    opt.zero_grad()
    with device.compute(len(idx)):
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
    opt.step()
    losses.append(loss.item())
full = F.cross_entropy(model(x), y).item()
client = opt._async
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{rank}.json").write_text(json.dumps({"max_gap": client.max_gap, "clock": client.clock,
                                                   "start_full_loss": start_full,
                                                   "final_full_loss": full}))
hetrain.shutdown()
