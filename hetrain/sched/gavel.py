"""Gavel's measured throughputs (``simulation_throughputs.json``) as scaling curves."""
from __future__ import annotations

import ast
import json
import os
from functools import lru_cache
from pathlib import Path

from ..errors import UserError
from ..perf.jobs import TableCurve


def default_data_dir() -> Path:
    """$HETRAIN_GAVEL_DATA, else ../shared/data/gavel next to the repository."""
    env = os.environ.get("HETRAIN_GAVEL_DATA")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    for cand in (repo.parent / "shared" / "data" / "gavel", repo / "data" / "gavel"):
        if cand.is_dir():
            return cand
    return repo.parent / "shared" / "data" / "gavel"


@lru_cache(maxsize=4)
def load_throughputs(path: str | None = None) -> dict[str, TableCurve]:
    """job type -> TableCurve of steps/s per GPU type and count (job alone, consolidated)."""
    p = Path(path) if path else default_data_dir() / "simulation_throughputs.json"
    if not p.is_file():
        raise UserError(f"throughput file {p} not found; pass --throughputs FILE or set HETRAIN_GAVEL_DATA")
    data = json.loads(p.read_text())
    table: dict[str, dict[str, dict[int, float]]] = {}
    for gpu_type, entries in data.items():
        if "_" in gpu_type:  # *_unconsolidated: the same jobs spread over machines
            continue
        for key, val in entries.items():
            job_type, g = ast.literal_eval(key)
            rate = val.get("null") if isinstance(val, dict) else None
            if rate is None:
                continue
            table.setdefault(job_type, {}).setdefault(gpu_type, {})[int(g)] = float(rate)
    return {jt: TableCurve(rates) for jt, rates in table.items()}
