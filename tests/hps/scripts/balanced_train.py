"""Train the reference model for one epoch through `BalancedLoader`: measured,
re-balanced shares on emulated devices of different speeds, overlapped push_pull; save
the parameters and the shares used. `--cuda`: the model and each micro-batch on
hetrain.device() (the CUDA worker of a mixed job; CPU workers stay on the CPU)."""
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.train.balance import BalanceConfig
from hetrain.train.loader import BalancedLoader

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from reference import GLOBAL_BATCH, data, make_model  # noqa: E402

out = Path(sys.argv[1])
overlap = True if "--overlap" in sys.argv else None  # None: the job's default (on in mode allreduce)
strategy = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--strategy=")), None)
tail = float(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--tail=")), 0.0))
probe_every = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--probe-every=")), 64))
ctx = hetrain.init()
rank = hetrain.rank()
machine = ctx.topology.proc(rank).machine
# calibrated device model (stable timing on a shared 2-core host): 10 ms per sample at speed 1
COST = 0.01
device = EmulatedDevice(machine.device, machine.name, cost_per_sample=COST)
dev = hetrain.device() if "--cuda" in sys.argv else torch.device("cpu")
model = make_model().to(dev)
opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), overlap=overlap)
loader = BalancedLoader(data(), GLOBAL_BATCH, optimizer=opt, model=model, seed=7, strategy=strategy, tail=tail,
                        config=BalanceConfig(probe_every=probe_every))
compute = []  # per step: samples, device speed, compute seconds (real + emulated), emulated sleep
trained = []  # per step: samples this worker trained on (its claimed tail chunks included), passes, and
# whether they were a probe's copies (timed out of the exchange, gradients dropped)
for x, y in loader:  # one epoch: 8 global batches of 24 and a last one of 8
    opt.zero_grad()
    n = passes = 0
    with device.compute(len(x)):
        # one pass, or equal micro-batches (accumulate), then any claimed tail chunks
        for mx, my in loader.micro_batches(x, y):
            mx, my = mx.to(dev), my.to(dev)
            (F.cross_entropy(model(mx), my) * (len(mx) / len(x))).backward()
            n, passes = n + len(mx), passes + 1
    compute.append([len(x), device.last_speed, device.last_s, device.last_sleep_s])
    trained.append([n, passes, int(loader.copies)])
    opt.step()
loader.finish()
out.mkdir(parents=True, exist_ok=True)
torch.save({"params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "sizes": torch.from_numpy(np.stack(loader.balancer.history)),
            "strategy": loader.balancer.strategy, "micro": loader.balancer.micro,
            "carried": loader.balancer.carried,  # exchanges whose rows rode the gradient all-reduce
            "order": torch.from_numpy(loader.batches.sampler.order(0)),
            "hidden_s": torch.tensor([s["hidden_s"] for s in hetrain.engine().stats.per_step]),
            "compute": torch.tensor(compute, dtype=torch.float64), "cost": COST,
            "trained": torch.tensor(trained),
            "slept": loader.batches.pace.slept,  # seconds it waited while sitting out (train/pace.py)
            # steps this worker exchanged in, sat out, and re-synchronisations (a worker rejoining)
            "exchanges": opt._members.exchanges, "sat_out": opt._members.sat_out, "resyncs": opt._members.resyncs}, out / f"rank{rank}.pt")
hetrain.shutdown()
