"""Gavel's measured throughputs (``simulation_throughputs.json``) as scaling curves, and
the Gavel/Philly traces shipped with hetrain (``hetrain/data/gavel``, MIT licence; its
README says which files were taken from Gavel and how they were reduced)."""
from __future__ import annotations

import ast
import json
import os
from functools import lru_cache
from pathlib import Path

from ..errors import UserError
from ..perf.jobs import TableCurve

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "gavel"


def default_data_dir() -> Path:
    """$HETRAIN_GAVEL_DATA (a full copy of Gavel's data), else the copy shipped in the package."""
    env = os.environ.get("HETRAIN_GAVEL_DATA")
    return Path(env) if env else BUNDLED


def bundled_traces() -> list[str]:
    """Names of the traces shipped with hetrain (usable as `--trace NAME`)."""
    return sorted(p.stem for p in (BUNDLED / "traces").glob("*.trace"))


def trace_path(name_or_path: str | Path) -> Path:
    """A trace file: an existing path, or the name of a shipped trace (``6214e9``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    for d in (default_data_dir(), BUNDLED):
        cand = d / "traces" / f"{p.name.removesuffix('.trace')}.trace"
        if p.parent == Path(".") and cand.is_file():
            return cand
    return p  # load_trace reports it missing, naming the shipped ones


@lru_cache(maxsize=4)
def load_throughputs(path: str | None = None) -> dict[str, TableCurve]:
    """job type -> TableCurve of steps/s per GPU type and count (job alone, consolidated)."""
    p = Path(path) if path else default_data_dir() / "simulation_throughputs.json"
    if not p.is_file():
        raise UserError(f"throughput file {p} not found; pass --throughputs FILE or set HETRAIN_GAVEL_DATA "
                        f"to a folder holding simulation_throughputs.json")
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
