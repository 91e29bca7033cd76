"""A sharded job (stage 3, uneven spans and batches) that commits a sharded checkpoint
every 2 steps; in round 0 worker 1 SIGKILLs itself at step 5 (mid-step, after the
commit of step 4). Every round resumes from the newest complete commit. Rank 0 writes
the final parameters (whole) to OUT as JSON lists."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn as nn

import hetrain
from tests.shard.procs import data, make_model

STEPS, BATCH, SPLIT, WEIGHTS = 8, 12, [6, 2, 4], (1.0, 4.0, 2.0)


def main(out: str) -> None:
    ctx = hetrain.init()
    rank = hetrain.rank()
    commits = Path(ctx.env.run_dir) / "shard-commits"
    model = make_model()
    opt = hetrain.shard(model, torch.optim.Adam(model.parameters(), lr=0.05),
                        hetrain.ShardConfig(stage=3, weights=WEIGHTS))
    start = 0
    latest = commits / "latest"
    if latest.is_file():  # the newest commit every worker finished writing
        start = int(latest.read_text())
        opt.load(commits / f"step-{start}")
    print(f"rank {rank} round {ctx.env.restart} starts at step {start}", flush=True)
    lo = sum(SPLIT[:rank])
    batches = data(STEPS, BATCH)
    for step in range(start, STEPS):
        if ctx.env.restart == 0 and rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches[step]
        opt.zero_grad()
        opt.set_batch_size(SPLIT[rank], total=BATCH)
        nn.functional.mse_loss(model(x[lo:lo + SPLIT[rank]]), y[lo:lo + SPLIT[rank]]).backward()
        opt.step()
        if (step + 1) % 2 == 0:
            opt.save(commits / f"step-{step + 1}")  # returns once every worker wrote its spans
            if rank == 0:
                tmp = commits / ".latest"
                tmp.write_text(str(step + 1))
                tmp.replace(latest)
    opt.gather_all()
    if rank == 0:
        Path(out).write_text(json.dumps([p.detach().reshape(-1).tolist() for p in model.parameters()]))


if __name__ == "__main__":
    main(sys.argv[1])
