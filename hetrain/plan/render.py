"""Plan output: a text table, a JSON document, and a PNG diagram of the stages."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import UserError
from ..fileio import format_validation_error
from .base import PlanResult, Problem

PLAN_FORMAT = "hetrain.plan/1"


class PlanStage(BaseModel):
    """One stage of a plan file, as the runtime reads it (other keys are kept)."""

    model_config = ConfigDict(extra="allow")
    layers: tuple[int, int] = Field(description="first layer and one past the last")
    type: str
    kind: str = ""
    instances: int = Field(ge=1, le=1_000_000)
    layer_names: list[str] | None = None

    @field_validator("layers")
    @classmethod
    def _ordered(cls, v):
        if not 0 <= v[0] < v[1]:
            raise ValueError(f"must be [first, end) with 0 <= first < end, got {list(v)}")
        return v


class PlanFile(BaseModel):
    """The fields of a plan JSON that `hetrain train --plan` needs."""

    model_config = ConfigDict(extra="allow")
    format: Literal["hetrain.plan/1"]
    feasible: bool
    reason: str = ""
    target: float = Field(gt=0)
    batch_size: int = Field(default=1024, ge=1, le=1_000_000_000)
    stages: list[PlanStage] = Field(min_length=1)

    @field_validator("target")
    @classmethod
    def _finite(cls, v):
        if not math.isfinite(v):
            raise ValueError("must be a finite number of samples/s")
        return v


class PlanError(UserError):
    """A plan file the runtime cannot run; the message names the field."""


def parse_plan(data: Any, source: str = "plan") -> PlanFile:
    """A feasible plan with its fields checked (PlanError naming each bad field)."""
    if not isinstance(data, dict):
        raise PlanError(f"invalid plan {source}: expected a JSON object with `stages` (a plan written by "
                        "`hetrain plan --out`)")
    if data.get("feasible") is not True:
        raise PlanError(f"the plan is not feasible ({data.get('reason', '')}); make a feasible plan first")
    try:
        return PlanFile.model_validate(data)
    except ValidationError as err:
        raise PlanError(format_validation_error(err, f"invalid plan {source}:", "docs/placement.md")) from None


def plan_to_dict(problem: Problem, result: PlanResult, model: str = "", catalogue: str = "") -> dict:
    """The plan JSON (format ``hetrain.plan/1``) the HeterPS runtime reads."""
    w, s = problem.workload, result.score
    names = w.layer_names or tuple(f"layer{i}" for i in range(w.n_layers))
    stages = []
    for st in s.stages:
        stages.append({
            "layers": [st.start, st.end],
            "layer_names": list(names[st.start:st.end]),
            "type": w.type_names[st.rtype] if w.type_names else st.rtype,
            "kind": w.type_kinds[st.rtype] if w.type_kinds else "",
            "instances": st.instances,
            "throughput": st.throughput,
            "time_per_sample_s": st.time_per_sample,
            "memory_bytes": st.memory if np.isfinite(st.memory) else None,
            "price_per_hour": st.hourly if np.isfinite(st.hourly) else None,
        })
    return {
        "format": PLAN_FORMAT,
        "model": model,
        "catalogue": catalogue,
        "planner": result.planner,
        "target": problem.target,
        "feasible": s.feasible,
        "reason": s.reason,
        "throughput": s.throughput,
        "price_per_hour": s.hourly if s.feasible else None,
        "n_samples": problem.n_samples,
        "cost_per_run": problem.run_cost(s) if s.feasible else None,
        "plan_s": result.plan_s,
        "batch_size": problem.params.batch_size,
        "assignment": [w.type_names[a] if w.type_names else a for a in s.assignment],
        "stages": stages,
        "info": {k: (v if not isinstance(v, float) or np.isfinite(v) else None) for k, v in result.info.items()},
    }


def load_plan(path: str | Path) -> dict:
    """Read a plan JSON written by `hetrain plan --out`; checks the format tag."""
    from ..errors import UserError

    from ..fileio import read_structured

    p = Path(path)
    data = read_structured(p, "plan file")
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise UserError(f"plan file {p} is not a hetrain plan (expected \"format\": \"{PLAN_FORMAT}\")")
    return data


def _money(x: float) -> str:
    return "-" if not np.isfinite(x) else f"${x:,.2f}"


def plan_table(problem: Problem, result: PlanResult) -> str:
    w, s = problem.workload, result.score
    names = w.layer_names or tuple(f"layer{i}" for i in range(w.n_layers))
    rows = [("stage", "layers", "type", "inst", "samples/s", "GiB/inst", "$/hour")]
    for i, st in enumerate(s.stages):
        lay = f"{st.start}-{st.end - 1} ({names[st.start]}..{names[st.end - 1]})" if st.end - st.start > 1 \
            else f"{st.start} ({names[st.start]})"
        rows.append((str(i), lay, w.type_names[st.rtype], str(st.instances), f"{st.throughput:,.0f}",
                     f"{st.memory / 2**30:.2f}" if np.isfinite(st.memory) else "-", _money(st.hourly)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(widths[c]) if c < 3 else v.rjust(widths[c]) for c, v in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in widths))
    lines.append("")
    lines.append(f"planner {result.planner}: {'feasible' if s.feasible else 'INFEASIBLE'}, "
                 f"planned in {result.plan_s:.2f} s")
    lines.append(f"throughput {s.throughput:,.1f} samples/s (target {problem.target:,.1f})")
    if s.feasible:
        lines.append(f"cost {_money(s.hourly)}/hour, {_money(problem.run_cost(s))} for a run of "
                     f"{problem.n_samples:,.0f} samples at the target rate")
        used = ", ".join(f"{n} x{u}" for n, u in zip(w.type_names, s.used) if u)
        lines.append(f"instances: {used}")
    else:
        lines.append(f"why: {s.reason}")
    return "\n".join(lines)


def plan_png(problem: Problem, result: PlanResult, path: str | Path, title: str = "") -> None:
    """Stages as coloured boxes along the layer chain, labelled with type x instances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w, s = problem.workload, result.score
    L = w.n_layers
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(min(16, 4 + 0.08 * L + 1.2 * len(s.stages)), 2.6))
    for i, st in enumerate(s.stages):
        ax.add_patch(plt.Rectangle((st.start, 0), st.end - st.start, 1, color=cmap(st.rtype % 10), alpha=0.85,
                                   ec="black"))
        ax.text((st.start + st.end) / 2, 0.5, f"S{i}\n{w.type_names[st.rtype]}\nx{st.instances}",
                ha="center", va="center", fontsize=7)
    ax.set_xlim(0, L)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("layer")
    ttl = title or f"{result.planner}: {s.throughput:,.0f} samples/s, {_money(s.hourly)}/h"
    ax.set_title(ttl, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
