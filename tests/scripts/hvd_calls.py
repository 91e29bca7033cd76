"""Every Horovod torch collective and DistributedOptimizer option, as a Horovod script
calls them (`import hetrain as hvd`), on ranks fed different inputs (hvd_inputs.py);
saves what each rank gets (tests/test_horovod_api.py compares it with single-process
references)."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain as hvd

sys.path.insert(0, str(Path(__file__).parent))
import hvd_inputs as I  # noqa: E402

out = Path(sys.argv[1])
hvd.init()
r, n = hvd.rank(), hvd.size()
res = {"basics": [r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
                  hvd.is_initialized(), hvd.is_homogeneous(), hvd.mpi_built(), hvd.gloo_built()]}

# the reductions, fused and not, in place and asynchronous
for i, op in enumerate(I.OPS):
    res[f"allreduce.{op}"] = hvd.allreduce(I.tensor(r, i), op=getattr(hvd, op), name=f"t{i}")
res["allreduce.average_false"] = hvd.allreduce(I.tensor(r, 0), average=False)
res["allreduce.scaled"] = hvd.allreduce(I.tensor(r, 0), prescale_factor=2.0, postscale_factor=0.25)
res["allreduce.int_sum"] = hvd.allreduce(torch.arange(4) + r, op=hvd.Sum)
res["allreduce.fp16"] = hvd.allreduce(I.tensor(r, 0), compression=hvd.Compression.fp16)
t = I.tensor(r, 1)
res["allreduce_.is_same"] = hvd.allreduce_(t, op=hvd.Sum) is t
res["allreduce_"] = t
h1, t2 = hvd.allreduce_async(I.tensor(r, 0)), I.tensor(r, 1)
h2 = hvd.allreduce_async_(t2, op=hvd.Max)
res["allreduce_async.poll"] = hvd.poll(h1)
res["allreduce_async"], res["allreduce_async_"] = hvd.synchronize(h1), hvd.synchronize(h2)
group = [I.tensor(r, 0), I.tensor(r, 1, (7,)), torch.tensor([r, 2 * r])]
res["grouped_allreduce"] = hvd.grouped_allreduce(group, op=hvd.Sum)
res["grouped_allreduce.adasum"] = hvd.grouped_allreduce(group[:2], op=hvd.Adasum)
res["grouped_allreduce_"] = hvd.grouped_allreduce_([I.tensor(r, 0), I.tensor(r, 1)])
res["grouped_allreduce_async"] = hvd.synchronize(hvd.grouped_allreduce_async([I.tensor(r, 2)], op=hvd.Min))

# gathers, broadcasts, all-to-all, reduce-scatter
res["allgather"] = hvd.allgather(I.gather_rows(r))
res["allgather_async"] = hvd.synchronize(hvd.allgather_async(I.gather_rows(r)))
res["allgather_object"] = hvd.allgather_object({"rank": r, "t": torch.arange(r + 1), "name": f"w{r}"})
res["broadcast"] = hvd.broadcast(I.tensor(r, 3), root_rank=n - 1)
t = I.tensor(r, 3)
hvd.broadcast_(t, root_rank=min(1, n - 1))
res["broadcast_"] = t
res["broadcast_async"] = hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), root_rank=0))
res["broadcast_object"] = hvd.broadcast_object({"epoch": 10 + r}, root_rank=min(1, n - 1))
res["alltoall"] = hvd.alltoall(torch.arange(2.0 * n) + 10 * r)
res["alltoall.splits"] = hvd.alltoall(I.a2a_input(r, n), splits=I.a2a_splits(r, n))
res["reducescatter"] = hvd.reducescatter(I.tensor(r, 4, (2 * n + 1, 2)))
res["reducescatter.sum"] = hvd.reducescatter(I.tensor(r, 4, (2 * n + 1, 2)), op=hvd.Sum)
res["alltoall_async"] = hvd.synchronize(hvd.alltoall_async(torch.arange(2.0 * n) + 10 * r))
res["reducescatter_async"] = hvd.synchronize(hvd.reducescatter_async(I.tensor(r, 4, (2 * n + 1, 2))))
res["grouped_allgather"] = hvd.synchronize(hvd.grouped_allgather_async([I.gather_rows(r), I.gather_rows(r) * 2]))
res["grouped_reducescatter"] = hvd.grouped_reducescatter([I.tensor(r, 4, (2 * n + 1, 2))], op=hvd.Sum)
hvd.barrier()

# SyncBatchNorm: each rank's batch has its own size; the global batch's statistics
bn = hvd.SyncBatchNorm(4)
x = I.bn_batch(r).requires_grad_()
y = bn(x)
(y * torch.arange(1.0, 3.0)).sum().backward()
res["syncbn"] = {"y": y.detach(), "dx": x.grad, "dw": hvd.allreduce(bn.weight.grad, op=hvd.Sum),
                 "mean": bn.running_mean.clone(), "var": bn.running_var.clone()}

# DistributedOptimizer: behaves as the wrapped class; op=, predivide, Adasum, accumulation
for key, kwargs in [("avg", {}), ("sum", {"op": hvd.Sum}), ("predivide", {"gradient_predivide_factor": 4.0}),
                    ("adasum", {"op": hvd.Adasum}), ("bpps", {"backward_passes_per_step": 1})]:
    model = I.model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kwargs)
    res[f"opt.{key}.isinstance"] = [isinstance(opt, torch.optim.SGD), isinstance(opt, hvd.DistributedOptimizer),
                                    type(opt).__name__]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if key == "bpps":
        opt.set_backward_passes_per_step(2)
    for step in range(I.STEPS):
        xb, yb = I.batch(r, step)
        opt.zero_grad()
        if key == "bpps":
            for half in (slice(0, 2), slice(2, 4)):
                (F.cross_entropy(model(xb[half]), yb[half]) / 2).backward()
        else:
            F.cross_entropy(model(xb), yb).backward()
        opt.step()
        sched.step()
    res[f"opt.{key}"] = {k: v.clone() for k, v in model.state_dict().items()}
    res[f"opt.{key}.lr"] = opt.param_groups[0]["lr"]
    res[f"opt.{key}.state_keys"] = sorted(opt.state_dict()["state"])

# sparse gradients exchanged densely
emb = torch.nn.Embedding(6, 2, sparse=True)
torch.nn.init.constant_(emb.weight, 1.0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), sparse_as_dense=True)
opt.zero_grad()
emb(torch.tensor([r, r + 1])).sum().backward()
opt.step()
res["sparse_as_dense"] = emb.weight.detach().clone()

# join: rank r has uneven_steps(r) batches; the others go on while it waits
model = I.model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
metrics = []
for step in range(I.uneven_steps(r)):
    xb, yb = I.batch(r, step)
    opt.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    metrics.append(hvd.allreduce(loss.detach(), name="loss"))
res["join.last"] = last = hvd.join()
hvd.broadcast_parameters(model.state_dict(), root_rank=last)  # Horovod's idiom: the last joiner's weights
res["join.model"] = {k: v.clone() for k, v in model.state_dict().items()}
res["join.metrics"] = torch.stack(metrics)
hvd.barrier()

# BytePS extras
hvd.declare("bps.t")
t = torch.full((3,), float(r))
res["push_pull_inplace"] = hvd.push_pull_inplace(t, average=True, name="bps.t") is t, t
hvd.suspend()
hvd.resume(num_workers=n)

out.mkdir(parents=True, exist_ok=True)
torch.save(res, out / f"rank{r}.pt")
hvd.shutdown()
