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
from ..perf.goodput import BatchModel, fit_one_gpu
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


# Gradient noise scale assumed per model family (samples; the order of magnitude of the
# critical batch sizes McCandlish et al. 2018 measured for such tasks, mid-training):
# the simulator's statistical efficiency. docs/scheduling.md states them; a real job
# measures its own (`hetrain.perf.goodput.NoiseScaleTracker`).
NOISE_SCALE = {"ResNet-18": 512.0, "ResNet-50": 2048.0, "Transformer": 1024.0, "LM": 128.0,
               "Recommendation": 16384.0}
MAX_BATCH_FACTOR = 16  # a job accepts global batches from its base batch up to 16x it


def _family(job_type: str) -> tuple[str, int] | None:
    """'ResNet-18 (batch size 64)' -> ('ResNet-18', 64); None for types without a batch."""
    head, sep, tail = job_type.partition(" (batch size ")
    if not sep or not tail.endswith(")"):
        return None
    return head, int(tail[:-1])


@lru_cache(maxsize=4)
def load_batch_models(path: str | None = None) -> dict[str, BatchModel]:
    """job type -> its goodput model, bootstrapped from one-GPU profiles: a family's
    members (the same model at other batch sizes) give, per GPU type, the step time at
    each batch on one GPU, fitted as fixed + per-sample seconds (`fit_one_gpu`); the
    largest batch that runs on one GPU of a type is that type's per-GPU memory limit.
    Types with no family or no assumed noise scale (A3C, CycleGAN) keep a fixed batch."""
    curves = load_throughputs(path)
    families: dict[str, dict[int, TableCurve]] = {}
    for jt, curve in curves.items():
        fam = _family(jt)
        if fam and fam[0] in NOISE_SCALE:
            families.setdefault(fam[0], {})[fam[1]] = curve
    out: dict[str, BatchModel] = {}
    for jt in curves:
        fam = _family(jt)
        if not fam or fam[0] not in families:
            continue
        name, m0 = fam
        members = families[name]
        per_sample, max_local = {}, {}
        for t in sorted({t for c in members.values() for t in c.rates}):
            prof = [(b, 1.0 / c.rate(t, 1)) for b, c in sorted(members.items()) if c.rate(t, 1) > 0]
            if not prof:
                continue
            max_local[t] = max(b for b, _ in prof)
            per_sample[t] = fit_one_gpu(*zip(*prof))[1] if len(prof) >= 2 else 0.0
        out[jt] = BatchModel(base_batch=m0, max_batch=m0 * MAX_BATCH_FACTOR, noise_scale=NOISE_SCALE[name],
                             per_sample_s=per_sample, max_local=max_local)
    return out
