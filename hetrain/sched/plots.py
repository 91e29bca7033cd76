"""PNG plots of a simulation: JCT CDF per policy, and GPUs in use per type over time."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_jct_cdf(results: Sequence, path: str | Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        jct = np.sort(r.jct) / 3600.0
        ax.step(jct, np.arange(1, len(jct) + 1) / len(jct), where="post",
                label=f"{r.policy} (avg {r.avg_jct_s / 3600:.2f} h)")
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title or "JCT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_timeline(result, path: str | Path, title: str = "") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    t = result.timeline_t / 3600.0
    used = result.timeline_used
    if len(t):
        ax.stackplot(t, used.T, labels=list(result.gpu_types), step="post")
        ax2 = ax.twinx()
        ax2.step(t, result.timeline_running, where="post", color="k", lw=0.8, label="running jobs")
        ax2.set_ylabel("running jobs")
    ax.set_xlabel("time (h)")
    ax.set_ylabel("GPUs allocated")
    ax.set_title(title or f"GPU allocation, {result.policy} on {result.cluster}")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
