"""`hetrain plan`: the whole job on a cluster file (`--cluster`: every communication mode,
share policy, overlap and codec predicted by the one cost model, ranked), or the
cheapest placement of a model's layers on a catalogue of resource types (`--catalogue`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="plan the whole job on a cluster (--cluster), or a layer placement (HeterPS, --catalogue)",
        description="With --cluster: predict step time, memory per device and cost of every way to train the "
                    "model on the cluster (all-reduce / BytePS / PS, equal or balanced shares, overlap, codec), "
                    "print them ranked and write the best as a plan for `hetrain launch --plan`. With "
                    "--catalogue: find which resource type runs each layer, how layers group into pipeline "
                    "stages and how many instances each stage gets, at least cost for a throughput "
                    "target; writes the plan as JSON and a PNG diagram.")
    p.add_argument("--model", required=True,
                   help="built-in model (ctr, cnn, transformer, transformer200; digits: the demo's, with "
                        "--cluster) or a profile .json")
    p.add_argument("--cluster", help="whole-job planning on this cluster file")
    p.add_argument("--target-throughput", type=float, help="--cluster: cheapest plan reaching this many samples/s")
    p.add_argument("--budget", type=float, help="--cluster: fastest plan costing at most this many $/hour")
    p.add_argument("--global-batch", type=int, default=64, help="--cluster: samples per step (64)")
    p.add_argument("--cost-per-sample", type=float, default=None,
                   help="--cluster: the devices run the calibrated device model (seconds per sample at speed 1, "
                        "as `hetrain demo` on emulated devices: 0.0005) instead of the profile's times")
    p.add_argument("--epochs", type=int, default=2, help="--cluster: epochs the written plan's script trains")
    p.add_argument("--catalogue",
                   help="catalogue YAML, a built-in (aws, gcp), or a launcher cluster file whose `kinds:` describe "
                        "its machines' device kinds (the plan then uses those machines)")
    p.add_argument("--throughput", type=float, help="--catalogue: target samples per second")
    p.add_argument("--planner", default="exact",
                   help="rl, exact, greedy, genetic, gpu (all on the cheapest GPU), cpu (default: exact)")
    p.add_argument("--samples", type=float, default=1e8, help="samples in the priced training run (1e8)")
    p.add_argument("--batch-size", type=int, default=512, help="global batch per step (512)")
    p.add_argument("--seed", type=int, default=0, help="seed for rl and genetic")
    p.add_argument("--out", default="plan.json", help="plan JSON path (plan.json)")
    p.add_argument("--png", default=None, help="stage diagram PNG path (default: next to --out)")
    p.add_argument("--save-profile", default=None, help="also write the layer profile JSON here")
    p.add_argument("--calibrate", action="append", default=[], metavar="TYPE[=DEVICE]",
                   help="use the profile's times measured on a real device (default: its GPU) for catalogue type "
                        "TYPE instead of the catalogue's speed table (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.cluster:
        return run_job(args)
    if not args.catalogue or args.throughput is None:
        raise UserError("give --cluster FILE (plan the whole job), or --catalogue and --throughput (a HeterPS "
                        "layer placement)")
    return run_placement(args)


def run_job(args: argparse.Namespace) -> int:
    from ..cluster.spec import load_cluster
    from .job import DEMO, demo_model, heterps_row, job_cluster, model_from_profile, plan_job, table, to_plan
    from .profile import load_or_profile

    if args.catalogue:
        raise UserError("give --cluster or --catalogue, not both")
    if args.target_throughput is not None and args.budget is not None:
        raise UserError("give --target-throughput or --budget, not both")
    for flag in ("target_throughput", "budget", "cost_per_sample"):
        v = getattr(args, flag)
        if v is not None and not v > 0:
            raise UserError(f"--{flag.replace('_', '-')} must be a positive number, got {v}")
    if not Path(args.out).resolve().parent.is_dir():
        raise UserError(f"--out {args.out}: the folder {Path(args.out).parent} does not exist")
    cluster = load_cluster(args.cluster)
    if args.model == DEMO:
        if args.cost_per_sample is None:
            raise UserError("--model digits (the demo) runs the calibrated device model: give --cost-per-sample "
                            "(the demo's default is 0.0005)")
        model, profile = demo_model(), None
    else:
        profile = load_or_profile(args.model, progress=not args.no_progress and sys.stderr.isatty())
        if args.save_profile:
            profile.save(args.save_profile)
        model = model_from_profile(profile)
    jc = job_cluster(cluster, profile, args.cost_per_sample)
    preds = plan_job(model, jc, args.global_batch, args.target_throughput, args.budget)
    print(f"model {model.name} ({model.grad_bytes / 1e6:.2f} MB of gradients), cluster {cluster.name}: "
          f"{len(jc.workers)} workers, {len(jc.cpu_bandwidth)} CPU machines; global batch {args.global_batch}")
    print(table(preds))
    print(heterps_row(profile, args.cluster, args.global_batch))
    best = preds[0]
    plan = to_plan(best, preds, model.name, cluster, jc, args.cost_per_sample, args.epochs)
    plan.save(args.out)
    print(f"chosen: {best.candidate.label()}, predicted {best.samples_per_s:.1f} samples/s; wrote {args.out} "
          f"(run it: hetrain launch --plan {args.out})")
    if not best.fits:
        print("hetrain: no candidate fits in the devices' memory; lower --global-batch or add memory", file=sys.stderr)
        return 1
    if args.target_throughput is not None and best.samples_per_s < args.target_throughput:
        print(f"hetrain: no candidate reaches {args.target_throughput:,.1f} samples/s; the fastest is written",
              file=sys.stderr)
        return 1
    if args.budget is not None and best.dollars_per_hour > args.budget:
        print(f"hetrain: no candidate costs at most ${args.budget}/hour; the cheapest is written", file=sys.stderr)
        return 1
    return 0


def run_placement(args: argparse.Namespace) -> int:
    from ..perf.pipeline import CostParams
    from .base import Problem
    from .planners import get_planner, planner_names
    from .catalogue import load_catalogue
    from .exact import max_throughput
    from .profile import load_or_profile
    from .render import plan_png, plan_table, plan_to_dict

    if args.planner not in planner_names():
        raise UserError(f"unknown planner {args.planner!r}; choose one of {planner_names()}")
    if not args.throughput > 0:
        raise UserError(f"--throughput must be a positive number of samples/s, got {args.throughput}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not args.samples > 0:
        raise UserError(f"--samples must be a positive number of samples, got {args.samples}")
    for flag, path in (("--out", args.out), ("--png", args.png), ("--save-profile", args.save_profile)):
        if path and not Path(path).resolve().parent.is_dir():  # before planning, which can take minutes
            raise UserError(f"{flag} {path}: the folder {Path(path).parent} does not exist; create it or "
                            "pick another path")
    catalogue = load_catalogue(args.catalogue)
    progress = not args.no_progress and sys.stderr.isatty()
    profile = load_or_profile(args.model, progress=progress)
    if args.save_profile:
        profile.save(args.save_profile)
    for dev in profile.devices:
        speed = ", ".join(f"{k} {v:.2f}x" for k, v in profile.calibrated_speed(dev).items())
        print(f"measured on {dev}: speed against the profiling host {speed}")
    for rule in args.calibrate:
        type_name, _, dev = rule.partition("=")
        if type_name not in catalogue.names:
            raise UserError(f"--calibrate {rule}: catalogue {catalogue.name!r} has no type {type_name!r}; "
                            f"choose one of {list(catalogue.names)}")
        profile = profile.with_device_as(type_name, dev or None)
    problem = Problem(profile.workload(catalogue), args.throughput,
                      CostParams(batch_size=args.batch_size), args.samples)
    kwargs = {}
    if args.planner in ("rl", "genetic"):
        kwargs["seed"] = args.seed
    if args.planner == "rl":
        kwargs["progress"] = progress
    result = get_planner(args.planner, **kwargs).plan(problem)
    print(f"model {profile.model} ({profile.n_layers} layers), catalogue {catalogue.name}")
    print(plan_table(problem, result))
    out = Path(args.out)
    import json
    out.write_text(json.dumps(plan_to_dict(problem, result, profile.model, catalogue.name), indent=1))
    png = Path(args.png) if args.png else out.with_suffix(".png")
    if result.feasible:
        plan_png(problem, result, png)
        print(f"wrote {out} and {png}")
        return 0
    best, _ = max_throughput(problem)
    print(f"wrote {out}")
    print(f"hetrain: no plan reaches {args.throughput:,.1f} samples/s with catalogue {catalogue.name}: "
          f"the best reachable throughput is {best:,.1f} samples/s "
          f"(within the available counts and memory); lower --throughput or add instances",
          file=sys.stderr)
    return 1
