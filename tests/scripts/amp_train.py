"""Mixed-precision training with torch.amp.GradScaler under a DistributedOptimizer, one
worker's loss overflowing at one step (an injected inf), in three loops: the plain one
(`scaler.step(opt)`) without and with overlap, and Horovod's documented one
(synchronize, unscale_, clip, skip_synchronize). Saves weights and scales per loop;
tests/test_amp.py compares them with one process."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain

sys.path.insert(0, str(Path(__file__).parent))
from reference import data, global_batch, make_model  # noqa: E402

STEPS, BAD_STEP, BAD_RANK = 5, 2, 1
out = Path(sys.argv[1])
hetrain.init()
rank, n = hetrain.rank(), hetrain.size()
x, y = data()
res = {}
for loop, overlap in (("plain", False), ("plain_overlap", True), ("horovod", True)):
    model = make_model()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), overlap=overlap)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    for step in range(STEPS):
        idx = global_batch(step).chunk(n)[rank]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        if step == BAD_STEP and rank == BAD_RANK:
            loss = loss * float("inf")  # this worker's gradients overflow; the others' do not
        scaler.scale(loss).backward()
        if loop == "horovod":
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
    res[loop] = {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "scale": scaler.get_scale()}
out.mkdir(parents=True, exist_ok=True)
torch.save(res, out / f"rank{rank}.pt")
hetrain.shutdown()
