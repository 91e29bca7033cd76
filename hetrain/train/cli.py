"""`hetrain report RUN_DIR`: PNG plots of a run's per-rank shares, step-time split and
bytes, from the `steps.jsonl` the training loop's StepLogger writes; for a job run from a
plan (`hetrain launch --plan`), its predicted against measured step time and memory."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError


_RANK_KEYS = ("samples", "compute_s", "comm_s", "wait_s", "hidden_s", "bytes")


def load_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "steps.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist: run a job that logs steps (e.g. `hetrain demo --run-dir {run_dir}`)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} line {n} is not valid JSON ({err.msg}); was the file cut short? "
                            "remove that line or re-run the job") from None
        missing = [k for k in ("step", "ranks") if not isinstance(row, dict) or k not in row]
        if missing:
            raise UserError(f"{path} line {n} has no {' or '.join(map(repr, missing))}: it is not a step record "
                            "written by hetrain.train.metrics.StepLogger")
        bad = [f"{lab}.{k}" for lab, r in row["ranks"].items() for k in _RANK_KEYS if k not in r] \
            if isinstance(row["ranks"], dict) else ["ranks"]
        if bad:
            raise UserError(f"{path} line {n}: missing {', '.join(bad)} in the step record")
        rows.append(row)
    if not rows:
        raise UserError(f"{path} is empty: the run logged no steps")
    return rows


def make_report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    run_dir = Path(run_dir)
    rows = load_steps(run_dir)
    out = Path(out) if out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    labels = list(rows[0]["ranks"])
    steps = np.array([r["step"] for r in rows])
    get = lambda k: np.array([[r["ranks"][lab][k] for lab in labels] for r in rows])  # noqa: E731
    samples = get("samples")
    shares = samples / np.maximum(samples.sum(1, keepdims=True), 1)
    written = []

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.stackplot(steps, shares.T, labels=labels)
    ax.set(xlabel="step", ylabel="share of the global batch", title="Per-rank batch shares", ylim=(0, 1))
    ax.legend(loc="upper right", fontsize="small")
    written.append(out / "shares.png")
    fig.savefig(written[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for k, name in (("compute_s", "compute"), ("comm_s", "communication (exposed)"), ("wait_s", "waiting")):
        v = get(k).sum(0)
        ax.bar(x - 0.15, v, width=0.3, bottom=bottom, label=name)
        bottom += v
    ax.bar(x + 0.2, get("hidden_s").sum(0), width=0.2, color="grey", hatch="//",
           label="communication hidden behind compute")
    ax.set_xticks(x, labels)
    ax.set(ylabel="seconds (whole run)", title="Step-time split per rank")
    ax.legend(fontsize="small")
    written.append(out / "time_split.png")
    fig.savefig(written[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, lab in enumerate(labels):
        ax.plot(steps, get("bytes")[:, i] / 1e6, label=lab)
    ax.set(xlabel="step", ylabel="MB on the wire (sent + received)", title="Bytes per step")
    ax.legend(fontsize="small")
    written.append(out / "bytes.png")
    fig.savefig(written[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    check = _prediction(run_dir)
    if check is not None:
        written.append(prediction_png(check, out / "prediction.png"))
    return written


def _prediction(run_dir: Path) -> dict | None:
    """The plan's prediction against the run, when the job ran from a plan (summary.json)."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("prediction")
    except json.JSONDecodeError:
        raise UserError(f"{path} is not valid JSON; re-run the job or remove the file") from None


def prediction_png(check: dict, path: Path) -> Path:
    """Measured step time per step against the plan's prediction, and memory per worker."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = np.array(check["measured_steps_s"]) * 1e3
    a.plot(np.arange(1, len(steps) + 1), steps, ".-", label="measured")
    a.axhline(check["predicted_step_s"] * 1e3, color="k", ls="--", label="predicted")
    a.axhline(check["measured_step_s"] * 1e3, color="C1", ls=":", label="measured (median)")
    err = check.get("step_error")
    a.set(xlabel="step", ylabel="ms per step", title=f"step time, {check.get('candidate', '')}"
          + (f" ({err:+.1%})" if err is not None else ""))
    a.legend(fontsize="small")
    labels = list(check["measured_memory"])
    x = np.arange(len(labels))
    b.bar(x - 0.2, [check["predicted_memory"].get(k, 0) / 2**20 for k in labels], 0.4, label="predicted")
    b.bar(x + 0.2, [check["measured_memory"][k] / 2**20 for k in labels], 0.4, label="measured")
    b.set_xticks(x, labels)
    b.set(ylabel="MiB (model state + activations)", title="memory per worker")
    b.legend(fontsize="small")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _cmd_report(args) -> int:
    paths = make_report(args.run_dir, args.out)
    for p in paths:
        print(p)
    return 0


def register(sub) -> None:
    p = sub.add_parser("report", help="draw a run's shares, step-time split and bytes as PNG plots",
                       description="Read RUN_DIR/steps.jsonl (written while training) and draw shares.png, "
                                   "time_split.png and bytes.png into RUN_DIR/report (or --out); for a job "
                                   "run from a plan, prediction.png: predicted against measured step time "
                                   "and memory.")
    p.add_argument("run_dir", help="the job's --run-dir")
    p.add_argument("--out", help="folder for the PNGs (default RUN_DIR/report)")
    p.set_defaults(func=_cmd_report)
