"""Print what this worker was given (torchrun's variables, its cores and threads) as
one JSON line, after a push_pull that proves the job formed."""
import json
import os

import torch

import hetrain

ctx = hetrain.init()
t = torch.full((4,), float(hetrain.rank() + 1))
hetrain.push_pull([("t", t)], average=False)
n = hetrain.size()
print("ENV " + json.dumps({
    **{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT", "OMP_NUM_THREADS")},
    "rank": hetrain.rank(), "size": n, "sum_ok": bool((t == n * (n + 1) / 2).all()),
    "affinity": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
    "machine": ctx.topology.proc(hetrain.rank()).machine.name if ctx.topology else None,
}), flush=True)
hetrain.shutdown()
