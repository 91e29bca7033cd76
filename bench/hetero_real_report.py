"""bench/hetero_real.py's table, summary and shares plot (the driver's half: from the
launched job's results)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _png(path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), sharey=True)
    labels = res["workers"]
    for ax, name in zip(axes, ("gpu", "cpu", "mixed")):
        sh = np.asarray(res[name]["shares"], dtype=float)
        frac = sh / np.maximum(sh.sum(1, keepdims=True), 1)
        ax.stackplot(np.arange(len(frac)), frac.T, labels=[f"{lab} ({d})" for lab, d in
                                                            zip(labels, res.get("devices") or labels)])
        ax.set(title=f"{name}: {res[name]['sps']:.0f} samples/s", xlabel="step", ylim=(0, 1))
    axes[0].set_ylabel("share of the global batch")
    axes[-1].legend(loc="lower right", fontsize="small")
    fig.suptitle(f"Shares over time (global batch {res['calibration']['global_batch']})")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _report(res: dict, a) -> dict:
    gpu, cpu, mixed = res["gpu"]["sps"], res["cpu"]["sps"], res["mixed"]["sps"]
    ideal = gpu + cpu
    summary = {"gpu_sps": gpu, "cpu_sps": cpu, "mixed_sps": mixed, "ideal_sps": ideal,
               "efficiency": mixed / ideal, "gpu_local_sps": res.get("gpu_local_sps"),
               "speedup_vs_gpu_local": mixed / res["gpu_local_sps"] if res.get("gpu_local_sps") else None,
               "cpu_over_gpu": cpu / gpu, "compute_spread": res["mixed"]["spread_median"],
               "compute_spread_p90": res["mixed"]["spread_p90"], "global_batch": res["calibration"]["global_batch"],
               "final_shares": res["mixed"]["shares"][-1]}
    # the best subset of the job's devices, each measured in this run through the same loader:
    # the GPU worker alone (the CPU workers sit out, out of the exchange) or the CPU workers alone
    best = "gpu" if gpu >= cpu else "cpu"
    summary.update(best_subset=best, best_subset_sps=max(gpu, cpu), mixed_over_best_subset=mixed / max(gpu, cpu))
    c = res["calibration"]
    print(f"\n== real heterogeneity: {res.get('gpu_name', '?')} + {a.cpu_workers} CPU workers x {a.threads} threads; "
          f"width-{res['calibration']['width']} MLP (of {a.widths}); global batch {summary['global_batch']} ==")
    p = c["predicted"]
    print(f"calibration (local, no communication): fixed s {np.round(c['fixed_s'], 4).tolist()}, "
          f"per-sample us {np.round(np.asarray(c['per_sample_s']) * 1e6, 2).tolist()}; "
          f"push_pull {c['push_pull_s'] * 1e3:.1f} ms")
    print(f"predicted here: GPU {p['gpu_sps']:.0f}, CPU {p['cpu_sps']:.0f}, mixed {p['mixed_sps']:.0f} "
          f"samples/s (mixed/ideal {p['efficiency']:.3f}, CPU/GPU {p['cpu_over_gpu']:.2f}); all predictions:")
    for w, cw in c["widths"].items():
        print(f"  width {w}: push_pull {cw['push_pull_s'] * 1e3:.1f} ms")
        for q in cw["candidates"]:
            print(f"    B={q['global_batch']:<8} step {q['step_s'] * 1e3:9.2f} ms  mixed/ideal {q['efficiency']:.3f}  "
                  f"CPU/GPU {q['cpu_over_gpu']:.3f}")
    print(f"{'run':<34}{'samples/s':>12}{'spread':>9}{'p90':>7}  final shares")
    rows = [("GPU worker alone (no comm)", summary["gpu_local_sps"], None, None, None),
            ("GPU only (in the job)", gpu, res["gpu"]["spread_median"], res["gpu"]["spread_p90"],
             res["gpu"]["shares"][-1]),
            ("CPU workers only (in the job)", cpu, res["cpu"]["spread_median"], res["cpu"]["spread_p90"],
             res["cpu"]["shares"][-1]),
            ("GPU + CPU, balanced", mixed, summary["compute_spread"], summary["compute_spread_p90"],
             summary["final_shares"]),
            ("ideal (GPU only + CPU only)", ideal, None, None, None)]
    for label, sps, spr, p90, sh in rows:
        f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{label:<34}{(sps or float('nan')):>12.0f}{f(spr):>9}{(f(p90) if p90 is not None else '-'):>7}  "
              f"{sh if sh is not None else ''}")
    for name in ("gpu", "cpu", "mixed"):
        ph = res[name]
        if "compute_ms" in ph:
            print(f"  {name:<6} step {ph['step_ms']:.2f} ms; per worker (ms, median): compute {ph['compute_ms']}, "
                  f"exchange {ph['comm_ms']}, waiting {ph['wait_ms']}")
    if all("step_ms" in res[k] for k in ("gpu", "cpu", "mixed")):
        # the same from the median step: a few long steps among a quick run's 15 move the wall-clock rate
        b = summary["global_batch"]
        g, c, m = (b / (res[k]["step_ms"] / 1e3) for k in ("gpu", "cpu", "mixed"))
        summary.update(gpu_sps_median_step=g, cpu_sps_median_step=c, mixed_sps_median_step=m,
                       efficiency_median_step=m / (g + c))
        print(f"from the median step (the mean where the first worker sat out): GPU only {g:.0f}, CPU only {c:.0f}, balanced {m:.0f} samples/s; "
              f"mixed / ideal {m / (g + c):.3f}")
    label = {"gpu": "the GPU worker alone", "cpu": "the CPU workers alone"}[summary["best_subset"]]
    print(f"mixed / best subset ({label}) = {summary['mixed_over_best_subset']:.3f} (bar 0.95)"
          + (f"; mixed / GPU alone without the job = {summary['speedup_vs_gpu_local']:.3f} (bar 0.9 where the CPU "
             "workers do not help)" if summary["speedup_vs_gpu_local"] else ""))
    if "mixed_sps_median_step" in summary:
        m, g, c = (summary[f"{k}_sps_median_step"] for k in ("mixed", "gpu", "cpu"))
        summary["mixed_over_best_subset_median_step"] = m / max(g, c)
    print(f"mixed / ideal = {summary['efficiency']:.3f} (bar 0.85, goal 0.95); compute spread "
          f"{summary['compute_spread'] if summary['compute_spread'] is None else round(summary['compute_spread'], 3)} "
          f"(bar 1.10, goal 1.05); CPU workers add {100 * summary['cpu_over_gpu']:.0f}% of the GPU's samples/s")
    return summary
