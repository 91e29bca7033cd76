"""The planner's view of the hardware vocabulary: a catalogue is an inventory
(`hetrain.cluster.hardware.Inventory`: device kinds with counts) whose every kind is
described well enough to price a plan: price per hour, memory, NIC bandwidth and speed
per layer kind.

YAML layout (see hetrain/data/catalogue_aws.yaml)::

    name: aws-us-east-1
    types:
      - name: p3.2xlarge          # unique: the device kind's name
        class: gpu                # cpu | gpu
        price_per_hour: 3.06      # $ per instance-hour
        count: 8                  # instances available
        memory: 16GiB             # per instance, where the layers' state lives
        bandwidth: 10gbit         # NIC, each direction
        speed: {dense: 20, memory: 11, sparse: 1.1}   # x faster than the profiling host

``speed`` gives, per layer kind (dense compute, memory-bound, sparse lookup), how many
times faster than the machine that measured the layer profile this type runs (one
number: the same on every layer kind). A launcher cluster file is a catalogue too: its
`kinds:` describe the kinds, its machines count them. Mistakes are reported with the
field's path and what to write instead.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import yaml

from ..cluster.files import parse_inventory
from ..cluster.hardware import HardwareError, Inventory
from ..errors import UserError
from ..fileio import read_structured

# what the cost model reads of every kind
PLANNING_FIELDS = ("price_per_hour", "memory", "bandwidth", "speed")


class CatalogueError(HardwareError):
    """A catalogue file that cannot be used."""


class PlanFitError(UserError):
    """A plan that needs device kinds, or more devices of a kind, than the hardware has."""


def _described(inv: Inventory, data: dict, source: str) -> Inventory:
    """`inv` if every kind has what the cost model reads, else one error naming each gap."""
    missing = inv.missing(PLANNING_FIELDS)
    if not missing:
        return inv
    if "types" in data:  # a catalogue: name each field by its path
        items = [f"types.{i}.{f}: required for planning; add it (see docs/placement.md)" for i, f in missing]
    else:
        by_kind: dict[str, list[str]] = {}
        for i, f in missing:
            by_kind.setdefault(inv.kinds[i].name, []).append(f)
        where = ("describe it under `kinds:` in the cluster file" if "machines" in data
                 else "GPU pools (`gpus:`) name kinds only; use a catalogue or a cluster file with `kinds:`")
        items = [f"kind {k!r} has no {', '.join(fs)}, which planning needs: {where} (see docs/placement.md)"
                 for k, fs in by_kind.items()]
    raise CatalogueError(f"invalid catalogue {source}: {' | '.join(items)}")


def parse_catalogue(data: object, source: str = "<dict>") -> Inventory:
    inv = parse_inventory(data, source, what="catalogue", error=CatalogueError, default_name="catalogue")
    return _described(inv, data, source)


BUILTIN = {"aws": "catalogue_aws.yaml", "gcp": "catalogue_gcp.yaml"}


def load_catalogue(path: str | Path) -> Inventory:
    """Load a catalogue; ``aws`` or ``gcp`` name the shipped examples. A launcher cluster
    file (with `kinds:` describing its machines' kinds) is read as the catalogue of its
    machines."""
    if str(path) in BUILTIN:
        text = resources.files("hetrain.data").joinpath(BUILTIN[str(path)]).read_text()
        source = f"<builtin {path}>"
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:  # pragma: no cover - shipped files are valid
            raise CatalogueError(f"catalogue {source} is not valid YAML: {err}") from None
        return parse_catalogue(data, source)
    if not Path(path).is_file():
        raise CatalogueError(f"catalogue file {path} does not exist (or use a built-in: {sorted(BUILTIN)})")
    data = read_structured(path, "catalogue", CatalogueError)
    inv = parse_inventory(data, str(path), what="catalogue", error=CatalogueError, default_name=Path(path).stem)
    return _described(inv, data, str(path))


def cost_arrays(catalogue: Inventory) -> dict[str, np.ndarray]:
    """Per kind, what the cost model (`perf.pipeline.Workload`) reads besides speeds."""
    return {
        "price": np.array([k.price_per_hour for k in catalogue.kinds], float),
        "count": np.array(catalogue.counts, float),
        "memory": np.array([k.memory for k in catalogue.kinds], float),
        "bandwidth": np.array([k.bandwidth for k in catalogue.kinds], float),
    }


def check_plan(plan: dict, hardware: Inventory, hardware_source: str, plan_source: str = "the plan") -> None:
    """Refuse, before anything starts, a plan whose stages need a device kind that
    `hardware` lacks, more devices of a kind than it has, or a kind of another class
    (a plan's `kind: gpu` stage on what the hardware calls a CPU)."""
    need: dict[str, int] = {}
    stages: dict[str, list[int]] = {}
    for s, st in enumerate(plan["stages"]):
        need[st["type"]] = need.get(st["type"], 0) + int(st["instances"])
        stages.setdefault(st["type"], []).append(s)
    problems = []
    for name, n in need.items():
        which = f"stage{'s' if len(stages[name]) > 1 else ''} {', '.join(map(str, stages[name]))}"
        have = hardware.count(name)
        if have == 0:
            problems.append(f"{which} run{'' if len(stages[name]) > 1 else 's'} on {name!r}, but there is no "
                            f"resource type {name!r}")
        elif have < n:
            problems.append(f"{which} need{'' if len(stages[name]) > 1 else 's'} {n} x {name!r}, it has {have}")
        else:
            cls = hardware.kind(name).device_class
            wrong = [s for s in stages[name] if plan["stages"][s].get("kind") not in (None, "", cls)]
            if wrong:
                problems.append(f"stage {wrong[0]} runs {name!r} as a {plan['stages'][wrong[0]]['kind']} kind, "
                                f"it is a {cls} kind there")
    if problems:
        raise PlanFitError(
            f"{plan_source} does not fit {hardware_source} ({hardware.describe()}): {'; '.join(problems)}. "
            f"Make the plan for this hardware (hetrain plan --catalogue {hardware_source} ...), or add what the "
            f"plan names (a catalogue's `types:`; a cluster file's machines, `device: {{kind: NAME}}`)")


def gavel_speed_ratios(path: str | Path) -> dict[str, dict[str, float]]:
    """Median throughput ratio P100/K80 and V100/K80 per layer kind from Gavel's
    measured single-GPU throughputs (dense: ResNet-18/50, CycleGAN; memory: Transformer,
    LM; sparse: Recommendation). Used to set the GPU speeds in the shipped catalogues."""
    import json

    data = json.loads(Path(path).read_text())
    cats = {"dense": ("ResNet-18", "ResNet-50", "CycleGAN"), "memory": ("Transformer", "LM"),
            "sparse": ("Recommendation",)}
    out: dict[str, dict[str, float]] = {}
    for kind, models in cats.items():
        keys = [k for k in data["v100"] if k.endswith(", 1)") and any(m in k for m in models)]
        out[kind] = {g: float(np.median([data[g][k]["null"] / data["k80"][k]["null"] for k in keys]))
                     for g in ("p100", "v100")}
    return out
