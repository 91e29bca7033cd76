"""`hetrain plan`: cheapest placement of a model's layers on a catalogue of resource types."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="cheapest layer placement meeting a throughput target (HeterPS)",
        description="Find which resource type runs each layer, how layers group into pipeline "
                    "stages and how many instances each stage gets, at least cost for a throughput "
                    "target. Writes the plan as JSON and a PNG diagram.")
    p.add_argument("--model", required=True,
                   help="built-in model (ctr, cnn, transformer, transformer200) or a profile .json")
    p.add_argument("--catalogue", required=True,
                   help="catalogue YAML, a built-in (aws, gcp), or a launcher cluster file whose `kinds:` describe "
                        "its machines' device kinds (the plan then uses those machines)")
    p.add_argument("--throughput", required=True, type=float, help="target samples per second")
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
    from ..perf.pipeline import CostParams
    from .base import Problem, get_planner, planner_names
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
