"""Several exchanges in one training step, run by `hetrain launch` (tests/test_several_optimizers.py
compares the weights with one process, `train(n=1, wrap=False)`):

- `split`: one model, two DistributedOptimizers over disjoint parameters (SGD with
  momentum for the first layers, Adam for the rest, as one keeps for embeddings and dense
  layers), one backward, both stepped, in either order;
- `gan`: a discriminator step, then a generator step whose loss backpropagates through
  the discriminator (its gradients there are never stepped);
- `loss`: one optimizer, and the loss averaged with push_pull between backward and
  step() (BytePS's way of logging it).

The last layers hold more than the first all-reduce bucket (1 MiB), so with overlap their
optimizer exchanges while backward runs. `--cuda`: models and batches on hetrain.device(),
so the CUDA stagings of each tensor list are kept and taken back at every switch; the
weights come back on the CPU."""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import hetrain
from hetrain.errors import UserError

STEPS, GB = 4, 16
DEV = torch.device("cpu")  # hetrain.device() with --cuda


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g).to(DEV), torch.randint(0, 4, (64,), generator=g).to(DEV)


def _net(*widths):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(DEV)


def _wrap(opt, named, wrap, overlap):
    return hetrain.DistributedOptimizer(opt, named_parameters=list(named), overlap=overlap) if wrap else opt


def split(rank, n, wrap, overlap, order):
    m = _net(8, 64, 640, 512, 4)
    x, y = _data()
    first = [(k, v) for k, v in m.named_parameters() if k.startswith("0.")]
    rest = [(k, v) for k, v in m.named_parameters() if not k.startswith("0.")]
    o1 = _wrap(torch.optim.SGD([v for _, v in first], lr=0.1, momentum=0.9), first, wrap, overlap)
    o2 = _wrap(torch.optim.Adam([v for _, v in rest], lr=1e-3), rest, wrap, overlap)
    for s in range(STEPS):
        idx = torch.arange(s * GB, (s + 1) * GB, device=DEV).chunk(n)[rank]
        o1.zero_grad()
        o2.zero_grad()
        F.cross_entropy(m(x[idx]), y[idx]).backward()
        for o in ((o1, o2) if order == "12" else (o2, o1)):
            o.step()
    return m


def gan(rank, n, wrap, overlap):
    g, d = _net(4, 32, 8), _net(8, 640, 512, 1)
    x, _ = _data()
    z = torch.randn(64, 4, generator=torch.Generator().manual_seed(2)).to(DEV)
    og = _wrap(torch.optim.SGD(g.parameters(), lr=0.05, momentum=0.9), g.named_parameters(), wrap, overlap)
    od = _wrap(torch.optim.SGD(d.parameters(), lr=0.05, momentum=0.9), d.named_parameters(), wrap, overlap)
    for s in range(STEPS):
        idx = torch.arange(s * GB, (s + 1) * GB, device=DEV).chunk(n)[rank]
        od.zero_grad()
        (F.softplus(-d(x[idx])).mean() + F.softplus(d(g(z[idx]).detach())).mean()).backward()
        od.step()
        og.zero_grad()
        F.softplus(-d(g(z[idx]))).mean().backward()  # d's parameters get gradients too
        og.step()
    return nn.ModuleDict({"g": g, "d": d})


def loss(rank, n, wrap, overlap):
    m = _net(8, 640, 512, 4)
    x, y = _data()
    o = _wrap(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(), wrap, overlap)
    losses = []
    for s in range(STEPS):
        idx = torch.arange(s * GB, (s + 1) * GB, device=DEV).chunk(n)[rank]
        o.zero_grad()
        lo = F.cross_entropy(m(x[idx]), y[idx])
        lo.backward()
        losses.append(float(hetrain.push_pull(lo.detach(), name="loss")) if wrap else float(lo.detach()))
        o.step()
    m.losses = losses
    return m


def too_early(rank, n) -> str:
    """A push_pull between zero_grad() and backward() while the optimizer's exchange has
    begun (its batch size known at zero_grad): refused with a message, and training goes
    on. Returns the message."""
    m = _net(8, 640, 512, 4)
    x, y = _data()
    o = _wrap(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), True, True)
    msg = ""
    for s in range(STEPS):
        idx = torch.arange(s * GB, (s + 1) * GB, device=DEV).chunk(n)[rank]
        o.set_batch_size(len(idx))
        o.zero_grad()
        if s == STEPS - 1:
            try:
                hetrain.push_pull(torch.ones(1, device=DEV), name="early")
            except UserError as err:
                msg = str(err)
        F.cross_entropy(m(x[idx]), y[idx]).backward()
        o.step()
    return msg


def many_layouts(rank) -> list[float]:
    """More tensor lists than the engine keeps layouts of (comm/known.py), each coming
    back: the evicted ones are learnt again. The averages, in call order."""
    out = []
    for _ in range(2):
        for k in range(11):
            t = torch.full((k + 1,), float(rank + 1), device=DEV)
            out.append(float(hetrain.push_pull(t, name=f"metric{k}")[-1]))
    return out


def train(n=1, rank=0, wrap=False, overlap=True):
    """Every case's weights (and the averaged losses) after STEPS steps."""
    def cpu(m):
        return {k: v.cpu() for k, v in m.state_dict().items()}

    out = {f"split{order}": cpu(split(rank, n, wrap, overlap, order)) for order in ("12", "21")}
    out["gan"] = cpu(gan(rank, n, wrap, overlap))
    m = loss(rank, n, wrap, overlap)
    out["loss"] = {**cpu(m), "losses": torch.tensor(m.losses)}
    return out


if __name__ == "__main__":
    hetrain.init()
    if "--cuda" in sys.argv:
        DEV = hetrain.device()
    res = {f"overlap={o}": train(hetrain.size(), hetrain.rank(), True, o) for o in (True, False)}
    res["too_early"] = too_early(hetrain.rank(), hetrain.size())
    res["many_layouts"] = many_layouts(hetrain.rank())
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.save(res, out / f"rank{hetrain.rank()}.pt")
    hetrain.shutdown()
