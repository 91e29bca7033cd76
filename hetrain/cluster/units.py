"""Parse human units in cluster files ("400mbit", "1gbit", "50MB/s", "4GiB")."""
from __future__ import annotations

import re

_RATE = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
         "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9}
_SIZE = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _parse(value: object, table: dict[str, float], what: str, example: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number or a string like {example!r}, got {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*([A-Za-z/]*)\s*", str(value))
        if not m:
            raise ValueError(f"cannot read {what} {value!r}; write it like {example!r}")
        unit = m.group(2).lower() or next(iter(table))
        if unit not in table:
            raise ValueError(f"unknown unit {m.group(2)!r} in {what} {value!r}; use one of {sorted(table)}")
        out = float(m.group(1)) * table[unit]
    if out <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return out


def parse_rate(value: object) -> float:
    """Bytes per second; a bare number is bytes/s."""
    return _parse(value, {"b/s": 1, **_RATE}, "bandwidth", "400mbit")


def parse_size(value: object) -> float:
    """Bytes; a bare number is bytes."""
    return _parse(value, _SIZE, "memory size", "4GiB")
