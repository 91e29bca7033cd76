"""GPU pools of a scheduling cluster: GPU types and how many of each.

Written on the command line as ``v100:8,p100:8,k80:8`` (Gavel's ``300:300:300`` form
means v100:p100:k80), or as a YAML file ``{name: lab, gpus: {v100: 8, k80: 4}}``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError

GAVEL_ORDER = ("v100", "p100", "k80")


class ClusterArgError(UserError):
    """A --cluster value that cannot be used."""


@dataclass(frozen=True)
class GpuCluster:
    types: tuple[str, ...]
    counts: tuple[int, ...]
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not self.types:
            raise ClusterArgError("the cluster has no GPU pool; write e.g. v100:8")
        if len(self.types) != len(self.counts):
            raise ClusterArgError("one count per GPU type is needed")
        if len(set(self.types)) != len(self.types):
            raise ClusterArgError(f"GPU type listed twice in {self.spec}; merge the counts")
        for t, c in zip(self.types, self.counts):
            if c < 1:
                raise ClusterArgError(f"GPU pool {t}:{c} needs a count >= 1")

    @property
    def spec(self) -> str:
        return ",".join(f"{t}:{c}" for t, c in zip(self.types, self.counts))

    @property
    def total(self) -> int:
        return int(sum(self.counts))

    @property
    def capacity(self) -> np.ndarray:
        return np.array(self.counts, dtype=np.int64)

    @property
    def largest_pool(self) -> int:
        return int(max(self.counts))

    def index(self, gpu_type: str) -> int:
        try:
            return self.types.index(gpu_type)
        except ValueError:
            raise ClusterArgError(f"GPU type {gpu_type!r} is not in cluster {self.spec}") from None


def parse_cluster_spec(text: str) -> GpuCluster:
    """Parse 'v100:8,p100:4', '300:300:300' (Gavel order v100:p100:k80) or a YAML path."""
    text = text.strip()
    path = Path(text)
    if text.endswith((".yaml", ".yml", ".json")) or path.is_file():
        return load_cluster_file(path)
    parts = text.split(":")
    if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
        return GpuCluster(GAVEL_ORDER, tuple(int(p) for p in parts), name=text)
    types, counts = [], []
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, count = item.partition(":")
        if not sep or not name or not count.strip().isdigit():
            raise ClusterArgError(f"bad cluster pool {item!r} in {text!r}; write TYPE:COUNT, e.g. v100:8,k80:4")
        types.append(name.strip().lower())
        counts.append(int(count))
    return GpuCluster(tuple(types), tuple(counts), name=text)


def load_cluster_file(path: Path) -> GpuCluster:
    from ..fileio import read_structured

    data = read_structured(path, "cluster file", ClusterArgError)
    gpus = data.get("gpus") if isinstance(data, dict) else None
    if not isinstance(gpus, dict) or not gpus:
        raise ClusterArgError(f"cluster file {path}: expected a mapping `gpus: {{v100: 8, k80: 4}}`")
    for t, c in gpus.items():
        if not isinstance(c, int) or isinstance(c, bool):
            raise ClusterArgError(f"cluster file {path}: gpus.{t} must be an integer count, got {c!r}")
    return GpuCluster(tuple(str(t).lower() for t in gpus), tuple(gpus.values()), name=str(data.get("name", path.stem)))
