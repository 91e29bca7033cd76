"""Per-step visibility for H-PS: every worker's batch share, step-time split (compute /
communication / waiting / hidden communication) and bytes on the wire.

Each step the workers all-gather one small float64 row (never pickled); rank 0 writes
the rows to TensorBoard and to `<run_dir>/steps.jsonl`, which `hetrain report RUN_DIR`
turns into PNG plots.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..perf.steptime import median_spread, spread

ROW = ("samples", "compute_s", "comm_s", "wait_s", "hidden_s", "bytes")


class StepLogger:
    def __init__(self, ctx, run_dir: str, writer=None):
        self.ctx = ctx
        self.rank = ctx.rank if ctx.distributed else 0
        self.labels = ctx.topology.worker_labels if ctx.topology else ["w0"]
        # async / bounded staleness: no per-step collective (it would put workers in lock-step);
        # rank 0 logs its own row only
        self.gather = ctx.distributed and ctx.comm.synchronous and len(self.labels) > 1
        if ctx.distributed and not self.gather:
            self.labels = [self.labels[self.rank]]
        self.writer = writer
        self.path = Path(run_dir) / "steps.jsonl"
        self._fh = None
        if self.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("w")
        self._last = {"comm_s": 0.0, "wait_s": 0.0, "hidden_s": 0.0, "bytes": 0}
        self.totals = {k: [0.0] * len(self.labels) for k in ROW}
        self.spreads: list[float] = []  # per step: max/min compute time over the workers with samples

    def log(self, step: int, samples: int, compute_s: float, engine_stats) -> None:
        """Record this worker's step (a collective over the workers: call on all, every step)."""
        st = engine_stats
        now = {"comm_s": st.comm_s, "wait_s": st.wait_s, "hidden_s": getattr(st, "hidden_s", 0.0),
               "bytes": st.bytes_sent + st.bytes_received}
        mine = {"samples": samples, "compute_s": compute_s, **{k: now[k] - self._last[k] for k in now}}
        self._last = now
        t = torch.tensor([float(mine[k]) for k in ROW], dtype=torch.float64)
        if self.gather:
            rows = [torch.zeros_like(t) for _ in self.labels]
            try:
                dist.all_gather(rows, t, group=self.ctx.worker_group)
            except RuntimeError as err:
                raise self.ctx.peer_error("gathering step metrics", [], err) from None
        else:
            rows = [t]
        self.write(step, [dict(zip(ROW, r.tolist())) for r in rows])

    def write(self, step: int, table: list[dict[str, float]]) -> None:
        """Record one step's rows, already gathered (every worker calls it; rank 0 writes).
        `BalancedLoader(logger=...)` calls this with the rows it gathers anyway."""
        for i, r in enumerate(table):
            for k in ROW:
                self.totals[k][i] += r[k]
        s = spread([r["compute_s"] for r in table], [r["samples"] for r in table])
        self.spreads.append(s)
        if self._fh is None:
            return
        self._fh.write(json.dumps({"step": step, "compute_spread": s if s == s else None,
                                   "ranks": dict(zip(self.labels, table))}) + "\n")
        self._fh.flush()
        if self.writer is not None:
            total = sum(r["samples"] for r in table) or 1
            for lab, r in zip(self.labels, table):
                self.writer.add_scalar(f"share/{lab}", r["samples"] / total, step)
                for k in ("compute_s", "comm_s", "wait_s", "hidden_s"):
                    self.writer.add_scalar(f"time_{k[:-2]}/{lab}", r[k], step)
                self.writer.add_scalar(f"bytes/{lab}", r["bytes"], step)
            if s == s:
                self.writer.add_scalar("balance/compute_spread", s, step)

    def spread_median(self, skip: int = 16) -> float:
        """Median over steps (after the first `skip`, while the fits settle) of the compute
        spread: the slowest worker's compute per step over the fastest's."""
        return median_spread(self.spreads, skip)

    def summary(self) -> str:
        """Totals per rank (printed at the end of a run by rank 0)."""
        head = f"{'rank':<8}{'share':>7}{'compute s':>11}{'comm s':>8}{'wait s':>8}{'hidden s':>10}{'MB':>9}"
        lines = [head, "-" * len(head)]
        tot = sum(self.totals["samples"]) or 1
        for i, lab in enumerate(self.labels):
            g = {k: self.totals[k][i] for k in ROW}
            lines.append(f"{lab:<8}{g['samples'] / tot:>7.3f}{g['compute_s']:>11.2f}{g['comm_s']:>8.2f}"
                         f"{g['wait_s']:>8.2f}{g['hidden_s']:>10.2f}{g['bytes'] / 1e6:>9.2f}")
        if len(self.labels) > 1 and self.spreads:
            lines.append(f"compute spread per step (slowest / fastest worker, median after step 16): "
                         f"{self.spread_median():.3f}")
        return "\n".join(lines)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
