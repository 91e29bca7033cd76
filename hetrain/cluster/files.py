"""Every hardware file as an inventory (`hetrain.cluster.hardware.Inventory`).

Three forms, told apart by their top-level key:

- `machines:` a launcher cluster file: its worker machines' device kinds, counted
  (`ClusterSpec.inventory`), described by its `kinds:`;
- `types:` a catalogue: every kind described, with a count;
- `gpus:` GPU pools: `{name: lab, gpus: {v100: 8, k80: 4}}`, bare kinds.

So the planner (`hetrain plan --catalogue FILE`) and the scheduler (`hetrain schedule
--cluster FILE`) read the launcher's own cluster files as well as their own forms.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from ..fileio import read_structured, validate_file
from .hardware import CatalogueFile, HardwareError, Inventory, PoolsFile
from .spec import parse_cluster

FORMS = "`types:` (a catalogue), `gpus:` (GPU pools) or `machines:` (a cluster file)"


class OldSpellingWarning(FutureWarning):
    """A hardware file written in a form that still loads but has a newer spelling."""


def _renamed_class_keys(data: dict, source: str) -> dict:
    """Catalogues once wrote a kind's class as `kind: cpu|gpu`; it is `class:` now, since
    `kind` names a device kind everywhere else (`device: {kind: v100}`). Old files load,
    with one warning saying what to rename."""
    types = data.get("types")
    if not isinstance(types, list):
        return data
    old = [i for i, t in enumerate(types) if isinstance(t, dict) and "kind" in t and "class" not in t]
    if not old:
        return data
    warnings.warn(f"{source}: `kind: cpu|gpu` is the old spelling of `class: cpu|gpu` (types {old}); it still "
                  "loads, but rename the key to `class`", OldSpellingWarning, stacklevel=4)
    new_types = [{("class" if k == "kind" else k): v for k, v in t.items()} if i in old else t
                 for i, t in enumerate(types)]
    return {**data, "types": new_types}


def parse_inventory(data: object, source: str = "<dict>", *, what: str = "hardware file",
                    error: type[HardwareError] = HardwareError, default_name: str | None = None) -> Inventory:
    """Parsed YAML/JSON of any hardware form as an inventory (mistakes raise `error`,
    naming `source` and the field)."""
    if not isinstance(data, dict) or not ({"machines", "types", "gpus"} & set(data)):
        raise error(f"invalid {what} {source}: expected a mapping with {FORMS}")
    name = default_name or source
    if "machines" in data:
        return parse_cluster(data, source).inventory()
    if "types" in data:
        data = _renamed_class_keys(data, source)
        return validate_file(CatalogueFile, data, what=what, source=source, docs="docs/placement.md",
                             error=error).inventory(name)
    return validate_file(PoolsFile, data, what=what, source=source, docs="docs/scheduling.md",
                         error=error).inventory(name)


def load_inventory(path: str | Path, *, what: str = "hardware file",
                   error: type[HardwareError] = HardwareError) -> Inventory:
    """A hardware file of any form (by its keys) as an inventory; unnamed, it takes the file's stem."""
    return parse_inventory(read_structured(path, what, error), str(path), what=what, error=error,
                           default_name=Path(path).stem)
