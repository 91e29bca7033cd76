"""Elastic training for the fault tests: hetrain.elastic.State + run, a commit every
`--commit-every` steps, measured batch shares. A worker can be made to kill itself
(SIGKILL) at a global step in given rounds (`--kill-machine/--kill-rounds/--kill-step`);
other faults come from outside. Each worker logs the sample indices of every step it
ran (`seen-r<round>-<machine>.txt`); rank 0 prints `step G round R shares [...]` and
saves the final parameters to `<out>/final.pt`."""
import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hetrain
from hetrain.train.balance import Balancer
from hetrain.train.sampler import GlobalBatchSampler

SAMPLES, DIM, CLASSES = 240, 16, 10


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, DIM, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return x, y


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, CLASSES))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--commit-every", type=int, default=3)
    ap.add_argument("--step-sleep", type=float, default=0.1)
    ap.add_argument("--kill-machine", default="")
    ap.add_argument("--kill-rounds", default="")
    ap.add_argument("--kill-step", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = hetrain.init()
    rank, nw = hetrain.rank(), hetrain.size()
    x, y = data()
    model = make_model()
    opt = hetrain.DistributedOptimizer(make_optimizer(model.parameters()), named_parameters=model.named_parameters())
    sampler = GlobalBatchSampler(SAMPLES, args.batch, nw, seed=3)
    balancer = Balancer(ctx, args.batch)
    state = hetrain.elastic.State(model=model, optimizer=opt, sampler=sampler)
    machine = ctx.machine_name or "local"
    kill_rounds = {int(r) for r in args.kill_rounds.split(",") if r}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seen = (out / f"seen-r{state.round}-{machine}.txt").open("w")

    @hetrain.elastic.run
    def train(state):
        for epoch in sampler.epochs(args.epochs):
            for s in sampler.steps():
                if s % args.commit_every == 0:
                    state.commit()
                g = sampler.global_step
                if machine == args.kill_machine and state.round in kill_rounds and g == args.kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                shares = balancer.sizes
                idx = torch.from_numpy(sampler.indices(epoch, s, rank, shares))
                seen.write(f"{g} {','.join(str(int(i)) for i in idx)}\n")
                seen.flush()
                opt.zero_grad()
                opt.set_batch_size(len(idx))
                t0 = time.perf_counter()
                if len(idx):
                    F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
                balancer.record(len(idx), time.perf_counter() - t0)
                balancer.update()
                if rank == 0:
                    print(f"step {g} round {state.round} shares {[int(v) for v in shares]}", flush=True)
                time.sleep(args.step_sleep)
        state.commit()

    train(state)
    if rank == 0:
        torch.save(model.state_dict(), out / "final.pt")
    hetrain.shutdown()


if __name__ == "__main__":
    main()
