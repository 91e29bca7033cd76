"""A script written for torchrun's elastic restarts, nothing of hetrain in it: it
rendezvouses through env:// (`init_process_group()`), checkpoints every epoch, and after
a restart (TORCHELASTIC_RESTART_COUNT > 0) resumes from the checkpoint. `@record`
writes a failing rank's traceback to TORCHELASTIC_ERROR_FILE.

    python elastic_ddp.py OUT_DIR FAIL_AFTER_EPOCH   (0: never fail)

On the first attempt rank 1 fails after epoch FAIL_AFTER_EPOCH was saved; the final
weights are printed as `RESULT [...]` and must equal those of a run that never failed."""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

EPOCHS, STEPS, BATCH = 4, 5, 8


@record
def main() -> None:
    out, fail_after = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt, start = os.path.join(out, "ckpt.pt"), 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"]
    ddp = DDP(model)
    for epoch in range(start, EPOCHS):
        g = torch.Generator().manual_seed(1000 * epoch + rank)
        for _ in range(STEPS):
            x = torch.randn(BATCH, 8, generator=g)
            loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()
        if restart == 0 and rank == 1 and epoch + 1 == fail_after:
            raise RuntimeError("injected failure after a checkpoint")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    print("RESULT", json.dumps({"restart": restart, "weights": weights.tolist()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
