"""GPU pools of a scheduling cluster: an inventory of device kinds
(`hetrain.cluster.hardware.Inventory`), one pool per kind, indexed in order.

Written on the command line as ``v100:8,p100:8,k80:8`` (Gavel's ``300:300:300`` form
means v100:p100:k80), or as a file: GPU pools ``{name: lab, gpus: {v100: 8, k80: 4}}``,
a launcher cluster file (the kinds of its GPU machines, counted: one per worker
process) or a catalogue (its GPU types and counts). Names from the command line and
`gpus:` are lower-cased, as Gavel's throughputs name their GPUs.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from ..cluster.files import parse_inventory
from ..cluster.hardware import HardwareError, Inventory, parse_pools
from ..fileio import format_validation_error, read_structured

GAVEL_ORDER = ("v100", "p100", "k80")


class ClusterArgError(HardwareError):
    """A --cluster value that cannot be used."""


def gpu_pools(types, counts, name: str = "cluster") -> Inventory:
    """Pools of bare kinds (`DeviceKind.bare`): `gpu_pools(("v100", "k80"), (8, 4))`."""
    try:
        return Inventory.of(zip(types, counts, strict=True), name=name)
    except ValidationError as err:
        raise ClusterArgError(format_validation_error(err, f"GPU pools {name}:", "docs/scheduling.md")) from None


def parse_cluster_spec(text: str) -> Inventory:
    """Parse 'v100:8,p100:4', '300:300:300' (Gavel order v100:p100:k80) or a file path."""
    text = text.strip()
    path = Path(text)
    if text.endswith((".yaml", ".yml", ".json")) or path.is_file():
        # GPU pools (`gpus:`) are every kind they name, as on the command line; a launcher
        # cluster file or a catalogue gives its GPU kinds
        data = read_structured(path, "cluster file", ClusterArgError)
        inv = parse_inventory(data, text, what="cluster file", error=ClusterArgError, default_name=path.stem)
        return inv if "gpus" in data else inv.of_class("gpu")
    parts = text.split(":")
    if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
        return gpu_pools(GAVEL_ORDER, tuple(int(p) for p in parts), name=text)
    return parse_pools(text, error=ClusterArgError)

