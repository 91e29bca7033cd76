"""The sharded job of killed.py committed through `hetrain.elastic.State`: stage 3,
uneven spans and batches, a commit every 2 steps (every worker writes its shards); in
round 0 worker 1 SIGKILLs itself at step 5. The restarted round resumes from the newest
commit through `@hetrain.elastic.run`. Rank 0 writes the final parameters (whole) to OUT
as JSON lists; a State holding the sharded model itself is refused first."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn as nn

import hetrain
from hetrain.errors import UserError
from tests.shard.procs import data, make_model

STEPS, BATCH, SPLIT, WEIGHTS = 8, 12, [6, 2, 4], (1.0, 4.0, 2.0)


def main(out: str) -> None:
    ctx = hetrain.init()
    rank = hetrain.rank()
    model = make_model()
    opt = hetrain.shard(model, torch.optim.Adam(model.parameters(), lr=0.05),
                        hetrain.ShardConfig(stage=3, weights=WEIGHTS))
    try:
        hetrain.elastic.State(model=model, optimizer=opt)
        raise SystemExit("a State holding the sharded model was accepted")
    except UserError as err:
        assert "committed with 'optimizer'" in str(err), err
    state = hetrain.elastic.State(optimizer=opt, step=0)

    @hetrain.elastic.run
    def train(state) -> None:
        print(f"rank {rank} round {ctx.env.restart} starts at step {state.step}", flush=True)
        lo = sum(SPLIT[:rank])
        batches = data(STEPS, BATCH)
        while state.step < STEPS:
            if ctx.env.restart == 0 and rank == 1 and state.step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batches[state.step]
            opt.zero_grad()
            opt.set_batch_size(SPLIT[rank], total=BATCH)
            nn.functional.mse_loss(model(x[lo:lo + SPLIT[rank]]), y[lo:lo + SPLIT[rank]]).backward()
            opt.step()
            state.step += 1
            if state.step % 2 == 0:
                state.commit()

    train(state)
    opt.gather_all()
    if rank == 0:
        Path(out).write_text(json.dumps([p.detach().reshape(-1).tolist() for p in model.parameters()]))


if __name__ == "__main__":
    main(sys.argv[1])
