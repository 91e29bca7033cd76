"""A torchrun script that makes its own default process group on a backend that takes
CUDA tensors only (NCCL; on a CPU host "cuda:gloo", which refuses CPU tensors the same
way), then pushes host tensors through hetrain: its host traffic (step header, manifests,
all-reduce of host tensors, the last barrier) must go over hetrain's own gloo groups."""
import torch
import torch.distributed as dist

import hetrain

dist.init_process_group("nccl" if torch.cuda.is_available() else "cuda:gloo")
try:
    dist.all_reduce(torch.zeros(1))
    raise SystemExit("the default group accepted a CPU tensor: not an NCCL stand-in")
except RuntimeError:
    pass
hetrain.init()
rank = hetrain.rank()
t = torch.full((5,), float(rank + 1))
t = hetrain.push_pull(t, batch_size=rank + 1)  # (1*1 + 2*2) / 3
print(f"RESULT {rank} {t.tolist()}", flush=True)
hetrain.shutdown()
