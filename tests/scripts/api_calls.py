"""Every Horovod/BytePS-style call a ported script makes, on workers that start from
different states; saves what each rank ends with (tests/test_api_calls.py compares it
with single-process references)."""
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import hetrain
from hetrain.errors import UserError

sys.path.insert(0, str(Path(__file__).parent))
from reference import data, make_model  # noqa: E402

out = Path(sys.argv[1])
hetrain.init()
rank, n = hetrain.rank(), hetrain.size()
res = {"local": (hetrain.local_rank(), hetrain.local_size())}

# broadcast_parameters: every rank starts from its own weights and a counter buffer
torch.manual_seed(100 + rank)
net = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
with torch.no_grad():
    net[1].num_batches_tracked.fill_(2**40 + rank)  # int64 beyond float32's integers
hetrain.broadcast_parameters(net.state_dict(), root_rank=1)
res["params"] = {k: v.clone() for k, v in net.state_dict().items()}

# broadcast_optimizer_state: rank-specific histories (rank 2 never stepped: no state)
model = make_model()
adam = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), betas=(0.8, 0.9))
sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(2 - rank if rank < 2 else 0):
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + step + 1))
    adam.step()
    sgd.step()
hetrain.broadcast_optimizer_state(adam, root_rank=0)
hetrain.broadcast_optimizer_state(sgd, root_rank=0)
res["adam"] = adam.state_dict()
res["sgd"] = sgd.state_dict()

# broadcast_object: root's object wins; a refused object is an error on every rank
mine = {"epoch": 3 + rank, "names": ("a", "b"), "t": torch.arange(3) * (rank + 1), 7: [None, 1.5, b"x"]}
res["object"] = hetrain.broadcast_object(mine, root_rank=0)
try:
    hetrain.broadcast_object(object() if rank == 0 else None, root_rank=0)
    res["refused"] = None
except UserError as err:
    res["refused"] = str(err)

# push_pull on one tensor, sync and async (handles synchronized out of order)
def tensor(i, shape):
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) * (rank + 1) + 10 * i


shapes = [(3,), (2, 5), (7,)]
sync = [hetrain.push_pull(tensor(i, s), average=i != 1, name=f"t{i}", batch_size=rank + 1)
        for i, s in enumerate(shapes)]
inputs = [tensor(i, s) for i, s in enumerate(shapes)]
handles = [hetrain.push_pull_async(t, average=i != 1, name=f"t{i}", batch_size=rank + 1) for i, t in enumerate(inputs)]
for t in inputs:
    t.zero_()  # the caller may reuse its tensors at once
got = [None] * 3
got[2] = hetrain.synchronize(handles[2])  # completes 0 and 1 first
assert hetrain.poll(handles[0]) and hetrain.poll(handles[1])
got[0], got[1] = hetrain.synchronize(handles[0]), hetrain.synchronize(handles[1])
res["push_pull"], res["push_pull_async"] = sync, got
named = [("x", torch.full((4,), float(rank)))]
assert hetrain.push_pull(named, batch_size=1) is None  # the in-place list form still works
res["inplace"] = named[0][1]

# backward_passes_per_step: 2 micro-batches per worker per step, with and without overlap
x, y = data()
GLOBAL, N, STEPS = 24, 2, 3
for overlap in (False, True):
    model = make_model()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), overlap=overlap,
                                       backward_passes_per_step=N, compression=hetrain.Compression.none)
    for step in range(STEPS):
        idx = torch.arange(step * GLOBAL, (step + 1) * GLOBAL).chunk(n)[rank]
        opt.zero_grad()
        for micro in idx.chunk(N):
            (F.cross_entropy(model(x[micro]), y[micro]) / N).backward()
        opt.step()
    res[f"accumulated_overlap{int(overlap)}"] = {k: v.clone() for k, v in model.state_dict().items()}

# clipping, Horovod style: synchronize, clip the averaged gradients, step without a second exchange
model = make_model()
opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
for step in range(STEPS):
    idx = torch.arange(step * GLOBAL, (step + 1) * GLOBAL).chunk(n)[rank]
    opt.zero_grad()
    F.cross_entropy(model(x[idx]), y[idx]).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "exchanged twice" warning: skip_synchronize works
        with opt.skip_synchronize():
            opt.step()
res["clipped"] = {k: v.clone() for k, v in model.state_dict().items()}

# compression that the job does not run: refused (the servers decode with the job's codec)
try:
    hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=hetrain.Compression.fp16)
    res["fp16"] = None
except UserError as err:
    res["fp16"] = str(err)

out.mkdir(parents=True, exist_ok=True)
torch.save(res, out / f"rank{rank}.pt")
hetrain.shutdown()
