"""Train the reference model with *measured, re-balanced* shares on emulated devices of
different speeds and with overlapped push_pull; save parameters and the shares used."""
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.train.balance import Balancer
from hetrain.train.sampler import GlobalBatchSampler

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from reference import GLOBAL_BATCH, STEPS, data, global_batch, make_model  # noqa: E402

out = Path(sys.argv[1])
overlap = "--overlap" in sys.argv
ctx = hetrain.init()
rank, n = hetrain.rank(), hetrain.size()
machine = ctx.topology.proc(rank).machine
# calibrated device model (stable timing on a shared 2-core host): 10 ms per sample at speed 1
COST = 0.01
device = EmulatedDevice(machine.device, machine.name, cost_per_sample=COST)
x, y = data()
model = make_model()
opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), overlap=overlap)
balancer = Balancer(ctx, GLOBAL_BATCH)
sampler = GlobalBatchSampler(200, GLOBAL_BATCH, n)
compute = []  # per step: samples, device speed, compute seconds (real + emulated), emulated sleep
for step in range(STEPS):
    idx = global_batch(step)  # the reference's global batches, cut by the balancer's shares
    mine = torch.from_numpy(sampler.split(idx.numpy(), balancer.sizes)[rank])
    opt.zero_grad()
    opt.set_batch_size(len(mine))
    with device.compute(len(mine)):
        F.cross_entropy(model(x[mine]), y[mine]).backward()
    compute.append([len(mine), device.last_speed, device.last_s, device.last_sleep_s])
    opt.step()
    balancer.record(len(mine), device.last_s)
    balancer.update()
out.mkdir(parents=True, exist_ok=True)
torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()},
            "sizes": torch.from_numpy(np.stack(balancer.history)),
            "hidden_s": torch.tensor([s["hidden_s"] for s in hetrain.engine().stats.per_step]),
            "compute": torch.tensor(compute, dtype=torch.float64), "cost": COST}, out / f"rank{rank}.pt")
hetrain.shutdown()
