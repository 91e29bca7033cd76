"""The layout of one push_pull: how the flat buffer of a manifest is cut and moved.

Pure bookkeeping, derived identically by every rank from the manifest, the partition
plan, the codecs and the machines' worker ranks, and testable in-process:

- `bounds`: tensor i covers flat elements [bounds[i], bounds[i+1]);
- `touches`: for a range of the flat buffer, which partitions it fills and by how much
  (a partition can be sent once all its elements are in);
- `spans`: for each partition, the (tensor, flat lo, flat hi) pieces it is made of;
- `wire`: the codec segments and payload bytes of each partition (None: all fp32);
- `sizes`: bytes on the wire per partition (what the credit window counts);
- `pushers`: for each partition, the worker that pushes it from each machine. A machine
  with one worker pushes everything itself. On a machine with several workers the local
  workers first add their gradients (hierarchical scheme) and each partition is pushed
  by one of them, its `owner`, chosen so that every local worker pushes about the same
  bytes.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from .layout import Manifest
from .partition import Partition
from .wire import WirePart, wire_plan


def balanced_owners(sizes: Sequence[int], local: int) -> list[int]:
    """Local index of the worker that pushes each partition: the one with the fewest bytes
    so far (ties: the lowest index), walking partitions in priority order."""
    load = [0] * max(1, local)
    out = []
    for s in sizes:
        j = min(range(len(load)), key=lambda k: (load[k], k))
        out.append(j)
        load[j] += s
    return out


@dataclass(frozen=True)
class FlatLayout:
    manifest: Manifest
    parts: tuple[Partition, ...]
    bounds: tuple[int, ...]
    spans: tuple[tuple[tuple[int, int, int], ...], ...]
    tensor_touches: tuple[tuple[tuple[int, int], ...], ...]
    wire: tuple[WirePart, ...] | None
    sizes: tuple[int, ...]
    pushers: tuple[tuple[int, ...], ...]  # per partition: one worker rank per machine
    owners: dict  # local group size -> owner (local index) per partition

    @classmethod
    def build(cls, manifest: Manifest, parts: Sequence[Partition], codecs: Sequence[str] | None = None,
              machines: Sequence[Sequence[int]] = ((0,),)) -> "FlatLayout":
        parts = tuple(parts)
        bounds = [0]
        for e in manifest.entries:
            bounds.append(bounds[-1] + e.numel)
        if parts and parts[-1].start + parts[-1].length != bounds[-1]:
            raise ValueError(f"partitions cover {parts[-1].start + parts[-1].length} elements, manifest {bounds[-1]}")
        starts = [p.start for p in parts]
        touches = tuple(tuple(_touch(parts, starts, bounds[i], bounds[i + 1])) for i in range(len(manifest.entries)))
        spans: list[list[tuple[int, int, int]]] = [[] for _ in parts]
        for i, touch in enumerate(touches):
            a, b = bounds[i], bounds[i + 1]
            for pid, _ in touch:
                p = parts[pid]
                spans[pid].append((i, max(a, p.start), min(b, p.start + p.length)))
        wire = wire_plan(list(parts), manifest, list(codecs)) if codecs is not None and parts else None
        sizes = tuple(w.nbytes for w in wire) if wire is not None else tuple(p.length * 4 for p in parts)
        owners = {len(m): balanced_owners(sizes, len(m)) for m in machines if len(m) > 1}
        pushers = tuple(tuple(m[owners[len(m)][pid]] if len(m) > 1 else m[0] for m in machines)
                        for pid in range(len(parts)))
        return cls(manifest, parts, tuple(bounds), tuple(tuple(s) for s in spans), touches,
                   tuple(wire) if wire is not None else None, sizes, pushers, owners)

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    def tensor_range(self, i: int) -> tuple[int, int]:
        return self.bounds[i], self.bounds[i + 1]

    def touches(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(partition, elements of it inside flat [lo, hi)) for every partition the range meets."""
        return _touch(self.parts, [p.start for p in self.parts], lo, hi)

    def owner(self, pid: int, local: int) -> int:
        """Local index of the worker that pushes partition `pid` on a machine of `local` workers."""
        return 0 if local < 2 else self.owners[local][pid]

    def pushes(self, rank: int) -> list[int]:
        """Partitions that worker `rank` sends to the servers itself."""
        return [pid for pid, ps in enumerate(self.pushers) if rank in ps]

    def order(self, backward: bool) -> list[int]:
        """The fixed order in which partitions are posted or collectively reduced: priority
        order, or backward order (last layers first) when gradients arrive that way."""
        ids = list(range(len(self.parts)))
        return ids[::-1] if backward else ids


def _touch(parts, starts, lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    j = max(0, bisect.bisect_right(starts, lo) - 1)
    while j < len(parts) and parts[j].start < hi:
        p = parts[j]
        n = min(hi, p.start + p.length) - max(lo, p.start)
        if n > 0:
            out.append((j, n))
        j += 1
    return out
