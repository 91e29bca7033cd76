"""An elastic commit while a worker sits out of the gradient exchange, and a model with
batch norm whose buffers must follow a worker that rejoins: a fixed schedule of sets
(worker 0 out for steps 1-2 and 4), a commit after step 2 (rank 0, out then, writes one
of the commit's replicas), and every worker's model state saved right after the commit
and right after each rejoin's `set_exchange`, before that step's forward."""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import hetrain

SETS = [[0, 1, 2], [1, 2], [1, 2], [0, 1, 2], [1, 2], [0, 1, 2]]
COMMIT_AFTER = 2  # worker 0 is out of this step's exchange (and of the one before)
BATCH = 24


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def copy_state(model: nn.Module, opt) -> dict:
    return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "momentum": [opt.state[p]["momentum_buffer"].clone() if "momentum_buffer" in opt.state[p] else None
                         for p in model.parameters()]}


def main() -> None:
    out = Path(sys.argv[1])
    hetrain.init()
    rank = hetrain.rank()
    model = make_model()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
    opt.track_buffers(model)
    state = hetrain.elastic.State(model=model, optimizer=opt, directory=out / "elastic")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(len(SETS) * BATCH, 8, generator=g), torch.randint(0, 4, (len(SETS) * BATCH,), generator=g)
    saved = {"rejoined": {}}
    for s, members in enumerate(SETS):
        per = BATCH // len(members)
        mine = members.index(rank) if rank in members else -1
        idx = torch.arange(s * BATCH + mine * per, s * BATCH + (mine + 1) * per) if mine >= 0 else None
        opt.set_exchange(members)
        if s > 0 and rank in members and rank not in SETS[s - 1]:
            saved["rejoined"][s] = copy_state(model, opt)  # re-synchronised, before this step's forward
        if s > 0 and rank == 1:  # the source of every re-synchronisation here (the lowest rank of the last set)
            saved["rejoined"][s] = copy_state(model, opt)
        opt.set_batch_size(per if idx is not None else 0, total=BATCH)
        opt.zero_grad()
        if idx is not None:
            F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if s == COMMIT_AFTER:
            state.commit()
            saved["committed"] = copy_state(model, opt)
    opt.set_exchange(None, step=False)
    saved["final"] = copy_state(model, opt)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(saved, out / f"rank{rank}.pt")
    hetrain.shutdown()


if __name__ == "__main__":
    main()
