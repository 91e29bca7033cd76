"""`hetrain shard-plan`: which sharding stage a model gets on a cluster, and why.

Reads the cluster file's workers (each machine's `device.memory` cap, else `--memory`,
and its `device.speed`) and a model given by its units' sizes, runs the planner of
perf/shardmem.py and prints, per worker, its batch share, its share of every unit, its
predicted peak against its cap and its largest item; a plan that fits nowhere is refused
with the largest item and the worker it overflows."""
from __future__ import annotations

from ..errors import UserError

MiB = 2**20


def _units(text: str) -> tuple[int, ...]:
    """`590592x8,7690`: eight units of 590592 elements and one of 7690."""
    out: list[int] = []
    try:
        for part in text.split(","):
            size, _, count = part.partition("x")
            out += [int(size)] * (int(count) if count else 1)
    except ValueError:
        raise UserError(f"--units {text!r}: give unit sizes in elements, e.g. 590592x8,7690 "
                        "(eight units of 590592, one of 7690)") from None
    if not out or min(out) <= 0:
        raise UserError(f"--units {text!r}: every unit needs a positive number of elements")
    return tuple(out)


def _cmd(a) -> int:
    from ..cluster.spec import load_cluster
    from ..cluster.units import parse_size
    from ..perf.shardmem import ShardModel, ShardWorker, choose_plan

    cluster = load_cluster(a.cluster)
    fallback = parse_size(a.memory) if a.memory else None
    workers = []
    for m in cluster.workers:
        cap = m.device.memory if m.device.memory is not None else fallback
        if cap is None:
            raise UserError(f"machine {m.name} has no device.memory in {a.cluster or 'the default cluster'}; "
                            "set it there or give --memory")
        workers += [ShardWorker(m.name, float(cap), a.per_sample / m.device.speed)] * m.local_workers
    model = ShardModel("model", _units(a.units), act_bytes_per_sample=a.act_per_sample)
    plan = choose_plan(model, workers, a.global_batch)
    print(f"model: {model.numel:,} elements in {len(model.unit_numels)} units; replica + Adam state "
          f"{model.state_bytes / MiB:.1f} MiB")
    print(plan.why)
    print(f"{'worker':10} {'batch':>5} {'share':>6} {'peak MiB':>9} {'cap MiB':>8}  largest item")
    for w, b, f, p, items in zip(workers, plan.batch, plan.shares, plan.peak, plan.items):
        big = max(items, key=items.get)
        print(f"{w.name:10} {b:>5} {f:>6.3f} {p / MiB:>9.1f} {w.memory / MiB:>8.1f}  {big} ({items[big] / MiB:.1f} MiB)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("shard-plan", help="the sharding stage, shares and memory per worker of a model on a cluster",
                       description=__doc__.splitlines()[0])
    p.add_argument("--cluster", help="cluster file (default: the built-in cluster)")
    p.add_argument("--units", required=True, help="units' sizes in elements, e.g. 590592x8,7690")
    p.add_argument("--act-per-sample", type=float, default=0.0, help="activation bytes kept per sample")
    p.add_argument("--per-sample", type=float, default=0.01, help="compute seconds per sample at speed 1")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--memory", help="cap of workers whose device.memory is unset, e.g. 16GiB")
    p.set_defaults(func=_cmd)
