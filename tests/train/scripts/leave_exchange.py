"""Workers leave and rejoin the gradient exchange on a fixed schedule of sets (what a
BalancedLoader does when shares reach 0 and come back): each step's 24 samples are split
among the step's set only, and the others sit the step out. Saves the parameters, how
many exchanges this worker ran and how many re-synchronisations happened. `--cuda`: the
model on hetrain.device() (the GPU worker of a mixed job; the CPU workers stay on the CPU)."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from reference import GLOBAL_BATCH, data, make_model  # noqa: E402

# step -> the workers that train (and exchange) in it
SETS = [[0, 1, 2]] * 2 + [[0, 1]] * 2 + [[0, 1, 2]] + [[1]] + [[0, 2]] * 2  # 8 steps of 24 of 200 samples


def split(members: list[int], n: int) -> list[int]:
    sizes = [0] * n
    for k, w in enumerate(members):
        sizes[w] = GLOBAL_BATCH // len(members) + (k < GLOBAL_BATCH % len(members))
    return sizes


def main() -> None:
    out = Path(sys.argv[1])
    hetrain.init()
    rank, n = hetrain.rank(), hetrain.size()
    dev = hetrain.device() if "--cuda" in sys.argv else torch.device("cpu")  # the GPU worker's, with --cuda
    model = make_model().to(dev)
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
    x, y = data()
    moved = []  # per step: whether this worker's engines put bytes on the wire
    for s, members in enumerate(SETS):
        sizes = split(members, n)
        lo = sum(sizes[:rank])
        mine = torch.arange(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)[lo: lo + sizes[rank]]
        opt.set_exchange(members)
        opt.set_batch_size(sizes[rank], total=GLOBAL_BATCH)
        opt.zero_grad()
        if len(mine):
            F.cross_entropy(model(x[mine].to(dev)), y[mine].to(dev)).backward()
        before = opt._members.job.stats.bytes_sent
        opt.step()
        moved.append(opt._members.job.stats.bytes_sent > before)
    opt.set_exchange(None, step=False)  # the end: every worker brought up to date
    out.mkdir(parents=True, exist_ok=True)
    m = opt._members
    torch.save({"params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "moved": moved, "device": str(next(model.parameters()).device), "exchanges": m.exchanges, "sat_out": m.sat_out,
                "resyncs": m.resyncs, "steps": len(SETS)}, out / f"rank{rank}.pt")
    hetrain.shutdown()


if __name__ == "__main__":
    main()
