"""The one hardware vocabulary: device kinds, and inventories of them.

A *device kind* (`DeviceKind`) is what a device is: a name (`v100`, `p3.2xlarge`,
`cpu`), a class (`cpu` or `gpu`) and what is known of it: speed per layer kind against
the host that measured the layer profiles, memory per device, price per hour, NIC
bandwidth. An *inventory* (`Inventory`) is kinds with a count each. Every part that
reasons about hardware speaks it:

- the launcher's cluster files name each machine's kind (`device: {kind: v100}`) and
  may describe kinds (`kinds:`); `ClusterSpec.inventory()` counts the devices;
- the planner's catalogues are inventories whose kinds are fully described
  (`hetrain.plan.catalogue`);
- the scheduler's GPU pools (`v100:8,k80:4`) are inventories of named kinds
  (`hetrain.sched.cluster`).

A name means one kind in a file: it is looked up among the kinds the file describes;
a name described nowhere is a *bare* kind (`DeviceKind.bare`: `cpu` is a CPU, any
other name a GPU, which is how the launcher has always read `device.kind`).

On file, an inventory is a list of kinds with counts (a catalogue's `types:`) or a
mapping of names to counts (`gpus: {v100: 8}`); `hetrain.cluster.files` reads every
form, launcher cluster files included.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

import numpy as np
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import UserError
from ..fileio import Strict, format_validation_error
from .units import parse_rate, parse_size

LAYER_KINDS = ("dense", "memory", "sparse")
LayerKind = Literal["dense", "memory", "sparse"]
DeviceClass = Literal["cpu", "gpu"]
KIND_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}$"


class HardwareError(UserError):
    """A hardware description (cluster file, catalogue, GPU pools) that cannot be used."""


class Speed(Strict):
    """How many times faster than the host that measured the layer profiles, per layer
    kind. A single number (`speed: 4`) is the same speed on every layer kind."""

    dense: float = Field(gt=0, description="x host speed on compute-bound layers (matmul, conv)")
    memory: float = Field(gt=0, description="x host speed on memory-bound layers (norms, attention, activations)")
    sparse: float = Field(gt=0, description="x host speed on sparse lookups (embedding tables)")

    @model_validator(mode="before")
    @classmethod
    def _scalar(cls, value: object) -> object:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {k: value for k in LAYER_KINDS}
        return value

    def for_kind(self, kind: str) -> float:
        return float(getattr(self, kind))


class DeviceKind(Strict):
    """One kind of device and what is known of it. Only name and class are always
    known; a part that needs more (the planner: price, memory, bandwidth, speed) says
    which fields are missing (`missing`)."""

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    name: str = Field(pattern=KIND_NAME)
    device_class: DeviceClass = Field(alias="class", description="cpu or gpu")
    speed: Speed | None = None
    memory: float | None = Field(default=None, description="bytes per device, or a string like '16GiB'")
    price_per_hour: float | None = Field(default=None, gt=0, description="$ per device-hour (instance-hour)")
    bandwidth: float | None = Field(default=None, description="NIC bytes/s each way, or a string like '10gbit'")
    note: str = ""

    @field_validator("memory", mode="before")
    @classmethod
    def _mem(cls, v: object) -> float | None:
        return None if v is None else parse_size(v)

    @field_validator("bandwidth", mode="before")
    @classmethod
    def _bw(cls, v: object) -> float | None:
        return None if v is None else parse_rate(v)

    @classmethod
    def bare(cls, name: str) -> "DeviceKind":
        """A kind known only by its name: `cpu` is a CPU, every other name a GPU."""
        return cls(name=name, device_class="cpu" if name == "cpu" else "gpu")

    def missing(self, fields: Iterable[str]) -> list[str]:
        """Which of `fields` this description leaves unset."""
        return [f for f in fields if getattr(self, f) is None]

    def to_file(self) -> dict:
        """The description as written in a file (`class:`, numbers in bytes and bytes/s)."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)


class Stock(DeviceKind):
    """A kind and how many of it there are: one entry of a catalogue's `types:`."""

    count: int = Field(ge=1, description="devices (instances) available")

    def kind(self) -> DeviceKind:
        return DeviceKind(**{f: getattr(self, f) for f in DeviceKind.model_fields})


def _pool_problems(names: list[str], counts: Iterable[int]) -> str | None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        return f"kind(s) {dup} listed twice; give every kind its own name, or merge the counts"
    for n, c in zip(names, counts):
        if c < 1:
            return f"{n}:{c} needs a count >= 1"
    return None


class Inventory(Strict):
    """Device kinds and how many of each: the hardware a plan may use, a scheduler
    shares out, or a cluster file holds. Kinds keep their order (pool indices)."""

    name: str = "inventory"
    source: str = ""
    kinds: tuple[DeviceKind, ...] = Field(min_length=1)
    counts: tuple[int, ...]

    @model_validator(mode="after")
    def _check(self) -> "Inventory":
        if len(self.counts) != len(self.kinds):
            raise ValueError(f"{len(self.kinds)} kinds but {len(self.counts)} counts; give one count per kind")
        problem = _pool_problems(list(self.names), self.counts)
        if problem:
            raise ValueError(problem)
        return self

    @classmethod
    def of(cls, counts: dict[str, int] | Iterable[tuple[str, int]], name: str = "inventory",
           described: Iterable[DeviceKind] = ()) -> "Inventory":
        """Counts by kind name; kinds from `described`, else bare (`DeviceKind.bare`)."""
        book = {k.name: k for k in described}
        items = list(counts.items() if isinstance(counts, dict) else counts)
        return cls(name=name, kinds=tuple(book.get(n) or DeviceKind.bare(n) for n, _ in items),
                   counts=tuple(int(c) for _, c in items))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kinds)

    @property
    def total(self) -> int:
        return int(sum(self.counts))

    @property
    def capacity(self) -> np.ndarray:
        return np.array(self.counts, dtype=np.int64)

    @property
    def largest_pool(self) -> int:
        return int(max(self.counts))

    @property
    def spec(self) -> str:
        """`v100:8,k80:4`: the pools as written on a command line."""
        return ",".join(f"{n}:{c}" for n, c in zip(self.names, self.counts))

    def describe(self) -> str:
        return ", ".join(f"{n} x{c}" for n, c in zip(self.names, self.counts))

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise HardwareError(f"no kind {name!r} in {self.name!r}; it has {self.describe()}") from None

    def kind(self, name: str) -> DeviceKind:
        return self.kinds[self.index(name)]

    def count(self, name: str) -> int:
        """How many devices of kind `name` (0 where there is none)."""
        return self.counts[self.names.index(name)] if name in self.names else 0

    def restricted(self, keep) -> "Inventory":
        """Only the kinds whose names are in `keep` (order kept)."""
        keep = set(keep)
        pairs = [(k, c) for k, c in zip(self.kinds, self.counts) if k.name in keep]
        if not pairs:
            raise HardwareError(f"{self.name!r} has none of the kinds {sorted(keep)}; it has {self.describe()}")
        return Inventory(name=self.name, source=self.source, kinds=tuple(k for k, _ in pairs),
                         counts=tuple(c for _, c in pairs))

    def of_class(self, device_class: DeviceClass) -> "Inventory":
        """Only the kinds of one class (a scheduler's GPU pools of a cluster file)."""
        names = [k.name for k in self.kinds if k.device_class == device_class]
        if not names:
            raise HardwareError(f"{self.name!r} has no {device_class.upper()} kind; it has "
                                f"{', '.join(f'{k.name} ({k.device_class})' for k in self.kinds)}")
        return self.restricted(names)

    def missing(self, fields: Iterable[str]) -> list[tuple[int, str]]:
        """(kind index, field) for every field some kind leaves unset."""
        fields = tuple(fields)
        return [(i, f) for i, k in enumerate(self.kinds) for f in k.missing(fields)]

    def to_file(self) -> dict:
        """The catalogue form: `{name, source, types: [{name, class, ..., count}]}`."""
        out = {"name": self.name, "types": [k.to_file() | {"count": c} for k, c in zip(self.kinds, self.counts)]}
        return out | ({"source": self.source} if self.source else {})

    def to_pools(self) -> dict:
        """The GPU-pools form: `{name, gpus: {v100: 8}}` (names and counts only)."""
        return {"name": self.name, "gpus": dict(zip(self.names, self.counts))}


class CatalogueFile(Strict):
    """The catalogue form of an inventory: every kind described, with its count."""

    name: str | None = None
    source: str = ""
    types: tuple[Stock, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "CatalogueFile":
        problem = _pool_problems([t.name for t in self.types], (t.count for t in self.types))
        if problem:
            raise ValueError(problem)
        return self

    def inventory(self, default_name: str) -> Inventory:
        return Inventory(name=self.name or default_name, source=self.source,
                         kinds=tuple(t.kind() for t in self.types), counts=tuple(t.count for t in self.types))


class PoolsFile(Strict):
    """The GPU-pools form of an inventory: names and counts; kinds are bare."""

    name: str | None = None
    gpus: dict[str, Annotated[int, Field(strict=True, ge=1)]] = Field(
        min_length=1, description="kind name -> count, e.g. {v100: 8, k80: 4}")

    @field_validator("gpus")
    @classmethod
    def _lower(cls, v: dict[str, int]) -> dict[str, int]:
        lower = {str(k).lower(): c for k, c in v.items()}
        if len(lower) != len(v):
            raise ValueError(f"{sorted(v)} name one kind twice (names are not case-sensitive); merge the counts")
        return lower

    def inventory(self, default_name: str) -> Inventory:
        return Inventory.of(self.gpus, name=self.name or default_name)


def parse_pools(text: str, name: str | None = None, error: type[HardwareError] = HardwareError) -> Inventory:
    """`v100:8,k80:4` as an inventory of bare kinds (names lower-cased)."""
    pairs: list[tuple[str, int]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, count = item.rpartition(":")
        if not sep or not kind.strip() or not count.strip().isdigit():
            raise error(f"bad cluster pool {item!r} in {text!r}; write TYPE:COUNT (a device kind and how many), "
                        "e.g. v100:8,k80:4")
        pairs.append((kind.strip().lower(), int(count)))
    if not pairs:
        raise error("no pool given; write TYPE:COUNT (a device kind and how many), e.g. v100:8")
    problem = _pool_problems([n for n, _ in pairs], (c for _, c in pairs))
    if problem:
        raise error(f"pools {text!r}: {problem}")
    try:
        return Inventory.of(pairs, name=name or text)
    except ValidationError as err:  # a name the vocabulary does not allow
        raise error(format_validation_error(err, f"pools {text!r}:", "docs/scheduling.md")) from None
