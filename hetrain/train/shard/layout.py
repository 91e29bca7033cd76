"""Who owns which span of a unit's flat buffer: pure arithmetic, no torch, no processes.

Sharded data parallelism keeps every unit's parameters (a top-level module of the model)
as one flat vector; worker i owns the span `spans[i] = (start, end)` of it and holds the
optimizer state (and, from stage 2, the reduced gradient; at stage 3 the parameters too)
of that span only. Spans follow *memory weights*: a worker with twice the room holds
twice the elements, unlike ZeRO / FSDP, which split evenly.

`shares_by_memory` (perf/shardmem.py, shared with the planner) turns each worker's free bytes, the activations its batch share needs
and the bytes every worker holds whole whatever its share into those weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import UserError
from ...perf.shardmem import shares_by_memory  # noqa: F401  (re-exported: the one rule, shared with the planner)


def owner_spans(numel: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Split `numel` elements into consecutive spans proportional to `weights`
    (largest-remainder rounding, so the spans add up to `numel` exactly and no span is
    more than one element off its ideal size). A weight of 0 owns nothing."""
    if numel < 0:
        raise UserError(f"a unit of {numel} elements cannot be split; numel must be >= 0")
    w = [float(x) for x in weights]
    if not w or any(x < 0 or x != x for x in w) or sum(w) <= 0:
        raise UserError(f"shard weights {list(weights)!r} must be non-negative numbers with a positive sum "
                        "(one per worker)")
    total = sum(w)
    ideal = [numel * x / total for x in w]
    sizes = [int(v) for v in ideal]
    left = numel - sum(sizes)
    # hand the remaining elements to the largest remainders (ties: the lower rank)
    order = sorted(range(len(w)), key=lambda i: (-(ideal[i] - sizes[i]), i))
    for i in order[:left]:
        sizes[i] += 1
    spans, start = [], 0
    for n in sizes:
        spans.append((start, start + n))
        start += n
    return spans


@dataclass(frozen=True)
class UnitLayout:
    """One unit's flat buffer: each parameter's offset and shape, and the owners' spans."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def build(cls, name: str, shapes: Sequence[Sequence[int]], weights: Sequence[float]) -> "UnitLayout":
        offsets, total = [], 0
        for s in shapes:
            offsets.append(total)
            n = 1
            for d in s:
                n *= int(d)
            total += n
        return cls(name, tuple(tuple(int(d) for d in s) for s in shapes), tuple(offsets), total,
                   tuple(owner_spans(total, weights)))

    def span(self, rank: int) -> tuple[int, int]:
        return self.spans[rank]

    def overlap(self, rank: int, other: tuple[int, int]) -> tuple[int, int] | None:
        """The part of `other` (a span of another layout of the same unit) that `rank` owns here."""
        s, e = self.spans[rank]
        lo, hi = max(s, other[0]), min(e, other[1])
        return (lo, hi) if lo < hi else None
