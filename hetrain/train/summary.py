"""End-of-run summary: every worker's time split and bytes, gathered to rank 0 as a
float tensor (no pickling), printed as a table and written as JSON; for a job started
from a plan (`hetrain launch --plan`), the plan's predicted step time and memory per
worker beside the measured ones (`prediction_check`), also in TensorBoard."""
from __future__ import annotations

import json
import os
import statistics
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.env import PLAN_ENV, PROFILE_STEPS_ENV
from ..runtime.memory import SavedTensorCounter

FIELDS = ("samples", "steps", "wall_s", "compute_s", "comm_s", "wait_s", "hidden_s", "bytes", "step_s", "memory")
OPTIONAL = ("hidden_s", "step_s", "memory")  # overlapped exchange, median step time, measured memory (0 where
# a script does not measure them)


def gather_stats(ctx, mine: dict[str, float]) -> list[dict[str, float]]:
    t = torch.tensor([float(mine.get(f, 0.0) if f in OPTIONAL else mine[f]) for f in FIELDS], dtype=torch.float64)
    if not ctx.distributed:
        return [mine]
    out = [torch.zeros_like(t) for _ in range(ctx.num_workers)]
    dist.all_gather(out, t, group=ctx.worker_group)
    return [dict(zip(FIELDS, x.tolist())) for x in out]


LEGEND = ("seconds over the run, per worker: compute = forward + backward; comm = gradient exchange the step "
          "waited for after backward; hidden = exchange that ran during backward (--overlap; not in the step "
          "time); wait = waiting for slower workers at the step's start; other = the rest of the wall time (data, "
          "optimizer update, evaluation, start-up); speed = the device's emulated speed (1 = full)")


def format_table(rows: list[dict[str, float]], labels: list[str], devices: list[str] | None = None,
                 speeds: list[float] | None = None) -> str:
    """One line per worker, then the legend: `devices` (e.g. "cuda:0", "cpu/1t") adds a
    device column, `speeds` (the cluster file's emulated speed factors) a speed column.
    Every time column has one meaning wherever hetrain prints it (LEGEND)."""
    devices = devices or [""] * len(rows)
    width = max([len(d) for d in devices] + [6]) + 2
    total = sum(r["samples"] for r in rows) or 1
    head = (f"{'rank':<10}{'device':<{width}}" + (f"{'speed':>6}" if speeds else "")
            + f"{'share':>7}{'samples':>9}{'compute s':>11}{'comm s':>8}{'hidden s':>10}{'wait s':>8}{'other s':>9}"
            f"{'MB/step':>9}")
    lines = [head, "-" * len(head)]
    for i, (label, dev, r) in enumerate(zip(labels, devices, rows)):
        other = max(0.0, r["wall_s"] - r["compute_s"] - r["comm_s"] - r["wait_s"])
        mb = r["bytes"] / max(r["steps"], 1) / 1e6
        lines.append(f"{label:<10}{dev:<{width}}" + (f"{speeds[i]:>6.2f}" if speeds else "")
                     + f"{r['samples'] / total:>7.3f}{int(r['samples']):>9}{r['compute_s']:>11.2f}{r['comm_s']:>8.2f}"
                     f"{r.get('hidden_s', 0.0):>10.2f}{r['wait_s']:>8.2f}{other:>9.2f}{mb:>9.3f}")
    return "\n".join([*lines, *textwrap.wrap(LEGEND, width=max(len(head), 100))])


def emulated_speeds(ctx) -> list[float] | None:
    """Each worker's emulated speed factor as its cluster file gives it (None without a topology)."""
    if ctx.topology is None:
        return None
    return [p.machine.device.speed if p.machine.device is not None else 1.0 for p in ctx.topology.workers]


def write_summary(run_dir: str, summary: dict) -> Path:
    path = Path(run_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))
    return path


# ---- prediction against the run -------------------------------------------------------------

SKIP_STEPS = 3  # first steps left out of the measured step time (warm-up, shares settling)


def planned() -> dict | None:
    """The prediction of the plan this job runs (`hetrain launch --plan`), or None."""
    path = os.environ.get(PLAN_ENV)
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    return {"candidate": data.get("ranking", [{}])[0].get("candidate", ""), **data["predicted"]}


class StepClock:
    """Wall time of every training step (from one optimizer step to the next)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def median(self, skip: int = SKIP_STEPS) -> float:
        t = self.times[skip:] if len(self.times) > skip else self.times
        return statistics.median(t) if t else float("nan")


class ActivationMeter:
    """Bytes autograd keeps for backward in each step: the activation part of a worker's
    memory, counted the way the planner's profiler predicts it (`SavedTensorCounter`:
    each saved tensor once, parameters left out), the same on any device. Every step is
    recorded; the figures leave out the first `skip` steps (warm-up: the equal shares
    before the balancer settles), as the measured step time does."""

    def __init__(self, model=None) -> None:
        self.steps: list[tuple[int, int]] = []  # (saved bytes, samples) per metered step
        self._params = list(model.parameters()) if model is not None else []
        self._samples = 0

    def of(self, samples: int) -> "ActivationMeter":
        """Meter the next step, of `samples` samples."""
        self._samples = samples
        return self

    def _steady(self, skip: int) -> list[tuple[int, int]]:
        return self.steps[skip:] if len(self.steps) > skip else self.steps

    def peak(self, skip: int = SKIP_STEPS) -> int:
        """The largest step's saved bytes after the first `skip` steps (all steps when
        there are no more than `skip`)."""
        return max((b for b, _ in self._steady(skip)), default=0)

    def per_sample(self, skip: int = SKIP_STEPS) -> float:
        """The largest saved bytes per sample of a step after the first `skip` steps."""
        return max((b / n for b, n in self._steady(skip) if n > 0), default=0.0)

    def __enter__(self):
        self._counter = SavedTensorCounter(self._params).__enter__()
        return self

    def __exit__(self, *exc):
        self._counter.__exit__(*exc)
        self.steps.append((self._counter.total, self._samples))
        self._samples = 0


def state_bytes(model, optimizer) -> int:
    """Bytes of parameters, their gradients and the optimizer's state tensors."""
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    opt = getattr(optimizer, "optimizer", optimizer)  # hetrain's DistributedOptimizer wraps one
    for st in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return int(total)


def profile_steps() -> int:
    """Steps a profiling round runs (0: no limit, train as asked)."""
    return int(os.environ.get(PROFILE_STEPS_ENV, "0") or 0)


def model_facts(model, acts: ActivationMeter, skip: int = SKIP_STEPS) -> dict:
    """What a planner needs of the model, measured in the run: gradient bytes (fp32) and
    activation bytes kept for backward per sample (after the first `skip` steps)."""
    return {"grad_bytes": float(sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)),
            "act_bytes_per_sample": float(acts.per_sample(skip))}


def prediction_check(plan: dict, measured_step_s: float, memory: dict[str, float],
                     step_times: list[float]) -> dict:
    """Predicted against measured step time and memory per worker, with the relative errors."""
    pred_mem = plan.get("memory", {})
    return {"candidate": plan.get("candidate", ""), "predicted_step_s": plan["step_s"],
            "measured_step_s": measured_step_s,
            "step_error": measured_step_s / plan["step_s"] - 1.0 if plan["step_s"] > 0 else None,
            "predicted_memory": pred_mem, "measured_memory": memory,
            "memory_error": {k: memory[k] / pred_mem[k] - 1.0 for k in memory if pred_mem.get(k)},
            "measured_steps_s": step_times}


def log_prediction(writer, check: dict) -> None:
    """The comparison as TensorBoard scalars (per step, and per worker for memory)."""
    for i, t in enumerate(check["measured_steps_s"]):
        writer.add_scalar("plan/measured_step_s", t, i)
        writer.add_scalar("plan/predicted_step_s", check["predicted_step_s"], i)
    for k, v in check["measured_memory"].items():
        writer.add_scalar(f"plan/measured_memory_mb/{k}", v / 1e6, 0)
        if k in check["predicted_memory"]:
            writer.add_scalar(f"plan/predicted_memory_mb/{k}", check["predicted_memory"][k] / 1e6, 0)


def check_plan(rows: list[dict], labels: list[str], step_times: list[float], writer) -> dict | None:
    """The run's plan (if it was launched with one) against the measured run: prints the
    step-time comparison, logs it to TensorBoard and returns it for the summary (None
    without a plan). `rows`: per-worker dicts with "step_s" and "memory"."""
    plan = planned()
    if plan is None:
        return None
    check = prediction_check(plan, rows[0]["step_s"], {lab: r["memory"] for lab, r in zip(labels, rows)}, step_times)
    print(f"plan {check['candidate']}: predicted step {check['predicted_step_s'] * 1e3:.1f} ms, measured "
          f"{check['measured_step_s'] * 1e3:.1f} ms ({check['step_error']:+.1%})")
    if "/overlap/" in f"/{check['candidate']}/":
        # what the overlap did, measured, beside what the plan assumed of it
        hidden, exposed = rows[0].get("hidden_s", 0.0), rows[0]["comm_s"]
        check["hidden_fraction"] = hidden / (hidden + exposed) if hidden + exposed > 0 else None
        shown = f"{check['hidden_fraction']:.0%}" if check["hidden_fraction"] is not None else "none"
        print(f"overlap, measured on {labels[0]}: {hidden:.2f} s of the exchange ran during backward (hidden s), "
              f"{exposed:.2f} s after it (comm s): {shown} hidden; the plan assumed: {plan.get('why', '?')}")
    log_prediction(writer, check)
    return check
