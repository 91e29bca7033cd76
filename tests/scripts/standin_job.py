"""Every CUDA data path of the engine in one job, run under the CUDA stand-in
(tests/cudastandin) whose race checker ends the process on an unordered access.

Cluster (tests/test_cuda_standin.py): machine `m` with two GPUs (ranks 0, 1: the
hierarchical transport, its local group NCCL), machine `g` with one GPU (rank 2: the
server transport), one summation server. Each rank saves (got, want) pairs:

- push_pull of CUDA tensors through the job's engine: no codec, then fp16 / int8 / int4
  by name rules (the job's --codec-rule flags), overlap off (push_pull) and on (begin /
  ready in backward order / finish); host tensors pushed by the GPU workers;
- subgroup engines (all-reduce transport): ranks 0 and 1 over NCCL (CUDA work buffer),
  ranks 0 and 2 over gloo from pinned buffers (they share cuda:0), host tensors on both,
  and a repeated CUDA call speculated (the engine's `speculate`);
- training: DistributedOptimizer with overlap off and on, and DDP with hetrain's comm hook,
  each saved for comparison with the single-process reference.
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain
from hetrain.comm.engine import PushPull
from hetrain.comm.group import make_groups

sys.path.insert(0, str(Path(__file__).parent))
from reference import STEPS, data, global_batch, make_model, shares  # noqa: E402

out = Path(sys.argv[1])
ctx = hetrain.init()
rank, n = hetrain.rank(), hetrain.size()
dev = hetrain.device()
assert dev.type == "cuda", dev
machines = ctx.topology.worker_machines
pair, mixed = list(machines[0]), [machines[0][0], machines[1][0]]
groups = dict(zip(["pair", "mixed"], make_groups(ctx, [pair, mixed], ["pair", "mixed"])))
results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
SHAPES = [(40, 30), (40,), (700,), (3, 5)]


def exchange(key, eng, members, prefix, step, host=False, overlapped=False, speculate=False):
    """push_pull (or begin/ready/finish) of seeded tensors; record (got, exact average)."""
    weights = {r: 3 + 2 * r for r in members}
    total = sum(weights.values())
    exact, mine = None, None
    for r in members:
        g = torch.Generator().manual_seed(1000 * step + r)
        ts = [torch.randn(s, generator=g) * (1 + r) for s in SHAPES]
        flat = torch.cat([t.reshape(-1) for t in ts]) * weights[r] / total
        exact = flat if exact is None else exact + flat
        if r == rank:
            mine = ts
    named = [(f"{prefix}.{i}", t if host else t.to(dev) * 1.0) for i, t in enumerate(mine)]
    if overlapped:  # as gradient hooks do: each tensor handed over once it is final, last first
        eng.begin(named, weight=weights[rank], overlapped=True)
        for i in reversed(range(len(named))):
            eng.ready(i, named[i][1] if host else named[i][1].mul_(1.0))
        eng.finish([t for _, t in named])
    else:
        eng.push_pull(named, weight=weights[rank], speculate=speculate)
    assert all(t.device.type == ("cpu" if host else "cuda") for _, t in named)
    results[key] = (torch.cat([t.reshape(-1).cpu() for _, t in named]), exact)


job = hetrain.engine()
workers = list(ctx.topology.worker_ranks)
for step, (prefix, overlapped, host) in enumerate([("plain", False, False), ("plain", True, False),
                                                   ("cfp16", False, False), ("cint8", True, False),
                                                   ("cint4", False, False), ("host", False, True),
                                                   ("host", True, True)]):
    exchange(f"job.{prefix}.{'overlap' if overlapped else 'plain'}", job, workers, prefix, step, host, overlapped)
for name, group in groups.items():
    if group.member:
        eng = PushPull(ctx, group)
        # the third repeats the second's CUDA layout: speculated (the header beside the sums,
        # the results divided by Σb on the compute stream after the copy back)
        for step, (overlapped, host, spec) in enumerate([(False, False, False), (True, False, False),
                                                         (False, False, True), (False, True, False)]):
            kind = "speculated" if spec else "overlap" if overlapped else "plain"
            exchange(f"{name}.{'host' if host else 'cuda'}.{kind}", eng, group.ranks, "sub", 100 + step, host,
                     overlapped, spec)


def train(kind: str) -> dict:
    x, y = (t.to(dev) for t in data())
    model = make_model().to(dev)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        state = hetrain.HookState()
        net = DDP(model, process_group=ctx.worker_group, bucket_cap_mb=0.004)
        net.register_comm_hook(state, hetrain.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        net = model
        opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=model.named_parameters(), overlap=kind == "overlap")
    for step in range(STEPS):
        idx = global_batch(step)
        sizes = shares(len(idx), n)
        lo = sum(sizes[:rank])
        mine = idx[lo: lo + sizes[rank]].to(dev)
        opt.zero_grad()
        if kind == "ddp":
            state.batch_size = len(mine)
        else:
            opt.set_batch_size(len(mine))
        F.cross_entropy(net(x[mine]), y[mine]).backward()
        opt.step()
    assert all(p.device == dev for p in model.parameters())
    if kind == "ddp":  # DDP's buckets were device tensors: the hook took the CUDA staging
        assert state.flat is not None and state.flat.device == dev, state.flat.device
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


trained = {kind: train(kind) for kind in ("plain", "overlap", "ddp")}
out.mkdir(parents=True, exist_ok=True)
import standin  # noqa: E402  (tests/cudastandin, installed at start: its NCCL issue order)

torch.save({"exchanges": results, "trained": trained, "nccl": standin.nccl_log(),
            "nccl_devices": standin.nccl_devices(), "env": {k: os.environ.get(k) for k in (
                "NCCL_SOCKET_IFNAME", "TORCH_NCCL_BLOCKING_WAIT")}}, out / f"rank{rank}.pt")
hetrain.shutdown()
