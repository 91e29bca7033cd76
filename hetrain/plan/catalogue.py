"""Resource catalogue: the CPU and GPU instance types a plan may use, with prices.

YAML layout (see hetrain/data/catalogue_aws.yaml)::

    name: aws-us-east-1
    types:
      - name: p3.2xlarge          # unique
        kind: gpu                 # cpu | gpu
        price_per_hour: 3.06      # $ per instance-hour
        count: 8                  # instances available
        memory: 16GiB             # per instance, where the layers' state lives
        bandwidth: 10gbit         # NIC, each direction
        speed: {dense: 20, memory: 11, sparse: 1.1}   # x faster than the profiling host

``speed`` gives, per layer kind (dense compute, memory-bound, sparse lookup), how many
times faster than the machine that measured the layer profile this type runs.
Mistakes are reported with the field's path and what to write instead.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..cluster.units import parse_rate, parse_size
from ..fileio import format_validation_error, read_structured
from ..errors import UserError

LAYER_KINDS = ("dense", "memory", "sparse")


class CatalogueError(UserError):
    """A catalogue file that cannot be used."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeedSpec(_Strict):
    dense: float = Field(gt=0, description="x host speed on compute-bound layers (matmul, conv)")
    memory: float = Field(gt=0, description="x host speed on memory-bound layers (norms, attention, activations)")
    sparse: float = Field(gt=0, description="x host speed on sparse lookups (embedding tables)")

    def for_kind(self, kind: str) -> float:
        return float(getattr(self, kind))


class ResourceType(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,63}$")
    kind: Literal["cpu", "gpu"]
    price_per_hour: float = Field(gt=0)
    count: int = Field(ge=1)
    memory: float
    bandwidth: float
    speed: SpeedSpec
    note: str = ""

    @field_validator("memory", mode="before")
    @classmethod
    def _mem(cls, v: object) -> float:
        return parse_size(v)

    @field_validator("bandwidth", mode="before")
    @classmethod
    def _bw(cls, v: object) -> float:
        return parse_rate(v)


class Catalogue(_Strict):
    name: str = "catalogue"
    source: str = ""
    types: tuple[ResourceType, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "Catalogue":
        names = [t.name for t in self.types]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate resource type names {dup}; give every type its own name")
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.types)

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise CatalogueError(f"no resource type {name!r} in catalogue {self.name!r}; "
                                 f"it has {list(self.names)}") from None

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "price": np.array([t.price_per_hour for t in self.types], float),
            "count": np.array([t.count for t in self.types], float),
            "memory": np.array([t.memory for t in self.types], float),
            "bandwidth": np.array([t.bandwidth for t in self.types], float),
        }

    def restricted(self, names) -> "Catalogue":
        keep = [t for t in self.types if t.name in set(names)]
        return self.model_copy(update={"types": tuple(keep)})


def parse_catalogue(data: object, source: str = "<dict>") -> Catalogue:
    if not isinstance(data, dict):
        raise CatalogueError(f"invalid catalogue {source}: expected a mapping with a `types:` list")
    try:
        return Catalogue.model_validate(data)
    except ValidationError as err:
        raise CatalogueError(format_validation_error(err, f"invalid catalogue {source}:", "docs/placement.md")) from None


BUILTIN = {"aws": "catalogue_aws.yaml", "gcp": "catalogue_gcp.yaml"}


def load_catalogue(path: str | Path) -> Catalogue:
    """Load a YAML catalogue; ``aws`` or ``gcp`` name the shipped examples."""
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
    return parse_catalogue(read_structured(path, "catalogue", CatalogueError), str(path))


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
