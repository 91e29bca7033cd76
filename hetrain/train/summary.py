"""End-of-run summary: every worker's time split and bytes, gathered to rank 0 as a
float tensor (no pickling), printed as a table and written as JSON."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

FIELDS = ("samples", "steps", "wall_s", "compute_s", "comm_s", "wait_s", "bytes")


def gather_stats(ctx, mine: dict[str, float]) -> list[dict[str, float]]:
    t = torch.tensor([float(mine[f]) for f in FIELDS], dtype=torch.float64)
    if not ctx.distributed:
        return [mine]
    out = [torch.zeros_like(t) for _ in range(ctx.num_workers)]
    dist.all_gather(out, t, group=ctx.worker_group)
    return [dict(zip(FIELDS, x.tolist())) for x in out]


def format_table(rows: list[dict[str, float]], labels: list[str], devices: list[str] | None = None) -> str:
    """One line per rank; `devices` (e.g. "cuda:0", "cpu/1t") adds a device column."""
    devices = devices or [""] * len(rows)
    width = max([len(d) for d in devices] + [6]) + 2
    head = (f"{'rank':<10}{'device':<{width}}{'samples':>9}{'compute s':>11}{'comm s':>9}{'wait s':>9}"
            f"{'other s':>9}{'MB/step':>9}")
    lines = [head, "-" * len(head)]
    for label, dev, r in zip(labels, devices, rows):
        other = max(0.0, r["wall_s"] - r["compute_s"] - r["comm_s"] - r["wait_s"])
        mb = r["bytes"] / max(r["steps"], 1) / 1e6
        lines.append(f"{label:<10}{dev:<{width}}{int(r['samples']):>9}{r['compute_s']:>11.2f}{r['comm_s']:>9.2f}"
                     f"{r['wait_s']:>9.2f}{other:>9.2f}{mb:>9.3f}")
    return "\n".join(lines)


def write_summary(run_dir: str, summary: dict) -> Path:
    path = Path(run_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))
    return path
