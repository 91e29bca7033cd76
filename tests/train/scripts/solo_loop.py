"""One worker trains alone through BalancedLoader (the others capped at 0 samples, sitting
out): what every worker decided step by step (shares, exchanges of the balancer's rows,
the steps they were applied at), the samples each saw and the parameters at the end.
`--cuda`: the model on hetrain.device() (the GPU worker of a mixed job). `--by-speed`: no
caps; the workers' emulated speeds (the cluster file's) leave the slow ones out, probed
every few steps."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.train import balance_exchange
from hetrain.train.balance import BalanceConfig
from hetrain.train.loader import BalancedLoader

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from reference import GLOBAL_BATCH, data, make_model  # noqa: E402

EPOCHS = 15  # 9 steps each (24 of 200 samples, the last 8): 135 steps, past two metrics-only exchanges
WINDOW = 4
PROBE_EVERY = 12  # --by-speed


def main() -> None:
    out = Path(sys.argv[1])
    ctx = hetrain.init()
    rank, n = hetrain.rank(), hetrain.size()
    by_speed = "--by-speed" in sys.argv
    machine = ctx.topology.proc(rank).machine
    emulated = EmulatedDevice(machine.device, machine.name, cost_per_sample=0.002)
    dev = hetrain.device() if "--cuda" in sys.argv else torch.device("cpu")
    model = make_model().to(dev)
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
    x, y = data()
    caps = None if by_speed else [GLOBAL_BATCH] + [0] * (n - 1)
    loader = BalancedLoader((x, y, torch.arange(len(x))), GLOBAL_BATCH, optimizer=opt, model=model, device=dev,
                            max_samples=caps, config=BalanceConfig(window=WINDOW, recent=3, probe_every=PROBE_EVERY))
    bal = loader.balancer
    posts, applied, recorded = [], [], []  # the steps whose update started an exchange (gathered or carried)
    post, record = balance_exchange.exchange_rows, bal.record

    def counting_post(row, gather, carry):
        posts.append(bal.step)
        return post(row, gather, carry)

    def counting_record(samples, seconds):
        recorded.append((int(samples), float(seconds)))
        record(samples, seconds)

    balance_exchange.exchange_rows, bal.record = counting_post, counting_record
    syncs = []  # torch.cuda.synchronize calls while training (timing a step must not drain the device)
    if dev.type == "cuda":
        sync = torch.cuda.synchronize

        def counting_sync(*args, **kwargs):
            syncs.append(len(seen))
            return sync(*args, **kwargs)

        torch.cuda.synchronize = counting_sync
    seen, alone, copies = [], [], []  # copies: a probe's step on copies of samples (not trained on)
    for _ in loader.epochs(EPOCHS // 3 if by_speed else EPOCHS):
        for xb, yb, ib in loader:
            opt.zero_grad()
            if len(xb):
                if by_speed:
                    with emulated.compute(len(xb)):
                        F.cross_entropy(model(xb), yb).backward()
                else:
                    F.cross_entropy(model(xb), yb).backward()
            opt.step()
            seen.append([] if loader.copies else ib.cpu().tolist())
            copies.append(loader.copies)
            alone.append(loader.batches._alone)
            if bal.rows is not None:
                applied.append(bal.rows_step)
    loader.finish()
    if dev.type == "cuda":
        torch.cuda.synchronize = sync
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "device": str(next(model.parameters()).device), "seen": seen, "solo": bal.solo,
                "every": bal.exchange_every, "history": [h.tolist() for h in bal.history], "posts": posts,
                "applied": applied, "recorded": recorded, "exchanges": opt._members.exchanges,
                "sat_out": opt._members.sat_out, "syncs": syncs, "alone": alone, "copies": copies,
                "window": WINDOW, "cfg_every": bal.cfg.every}, out / f"rank{rank}.pt")
    hetrain.shutdown()


if __name__ == "__main__":
    main()
