"""Train a few SGD steps with unequal per-worker batch sizes; save the parameters.

--broadcast: workers other than rank 0 start from perturbed parameters and take rank 0's
with broadcast_parameters; --skip-sync: opt.synchronize(), then a (no-op) clip, then
`with opt.skip_synchronize(): opt.step()`, and the engine counts one exchange per step.
--cuda: the model and data on hetrain.device(); --sync-debug: backward runs under
torch.cuda.set_sync_debug_mode("error"), so a host sync in a gradient hook fails the job;
--sgd: plain SGD (no momentum), as the parameter servers of async/stale modes run it;
--show-collective: print how buckets move among processes of one host (comm/transports/collective.py)."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain

sys.path.insert(0, str(Path(__file__).parent))
from reference import STEPS, data, global_batch, make_model, shares  # noqa: E402

out = Path(sys.argv[1])
use_ddp = "--ddp" in sys.argv
skip_sync = "--skip-sync" in sys.argv
sync_debug = "--sync-debug" in sys.argv
momentum = 0.0 if "--sgd" in sys.argv else 0.9
ctx = hetrain.init()
rank, n = hetrain.rank(), hetrain.size()
dev = hetrain.device() if "--cuda" in sys.argv else torch.device("cpu")
x, y = (t.to(dev) for t in data())
model = make_model().to(dev)
if "--broadcast" in sys.argv:
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    hetrain.broadcast_parameters(model.state_dict(), root_rank=0)
if use_ddp:
    from torch.nn.parallel import DistributedDataParallel as DDP

    state = hetrain.HookState()
    ddp = DDP(model, device_ids=[dev] if dev.type == "cuda" else None, process_group=ctx.worker_group,
              bucket_cap_mb=0.004)  # several buckets
    ddp.register_comm_hook(state, hetrain.ddp_comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
else:
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                       named_parameters=model.named_parameters())
for step in range(STEPS):
    idx = global_batch(step)
    sizes = shares(len(idx), n)
    lo = sum(sizes[:rank])
    mine = idx[lo: lo + sizes[rank]].to(dev)
    opt.zero_grad()
    if use_ddp:
        state.batch_size = len(mine)
        F.cross_entropy(ddp(x[mine]), y[mine]).backward()
    else:
        opt.set_batch_size(len(mine))  # before backward: with overlap the hooks push during it
        loss = F.cross_entropy(model(x[mine]), y[mine])
        if sync_debug:
            torch.cuda.set_sync_debug_mode("error")
        loss.backward()
        if sync_debug:
            torch.cuda.set_sync_debug_mode("default")
    if skip_sync:
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
if "--show-collective" in sys.argv:  # how the all-reduce transport moves buckets (shared memory or not)
    tr = hetrain.engine().transport  # the all-reduce's strategy, or a machine's local one (hierarchical)
    coll = tr.collective if hasattr(tr, "collective") else getattr(tr, "shm", None)
    held = " buckets in shared memory" if getattr(coll, "arena", None) is not None else ""
    print(f"rank {rank} collective {type(coll).__name__}{held}", flush=True)
if skip_sync:
    print(f"exchanges {hetrain.engine().stats.steps} in {STEPS} steps", flush=True)
out.mkdir(parents=True, exist_ok=True)
torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
           out / f"rank{rank}{'-ddp' if use_ddp else ''}.pt")
hetrain.shutdown()
