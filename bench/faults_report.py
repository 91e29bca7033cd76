"""The fault campaign's report (bench/faults.py): the per-kind summary, its table and the
figure. Apart from the campaign so that each file stays one concern."""
from __future__ import annotations

import statistics
from pathlib import Path


def summarise(faults: list, kinds) -> list[dict]:
    """One row per fault kind (in the order of `kinds`): counts, recovery and report times."""
    rows = []
    for kind in kinds:
        fs = [f for f in faults if f.kind == kind]
        if not fs:
            continue
        rec = [f.recover_s for f in fs if f.recover_s is not None]
        rep = [f.report_s for f in fs if f.report_s is not None]
        rows.append({"kind": kind, "injected": len(fs), "recovered": sum(f.recovered for f in fs),
                     "reported": sum(f.reported for f in fs), "in_time": sum(f.in_time for f in fs),
                     "restarted": sum(f.restarted for f in fs), "lost_updates": sum(f.lost_updates for f in fs),
                     "hangs": sum(f.hang for f in fs),
                     "recover_s_median": statistics.median(rec) if rec else None,
                     "recover_s_max": max(rec) if rec else None,
                     "report_s_median": statistics.median(rep) if rep else None,
                     "damage_reported": sum(f.damage_reported for f in fs),
                     "survivors_naming": sum(f.survivors_naming for f in fs),
                     "survivors_total": sum(f.survivors_total for f in fs)})
    return rows


def table(rows: list[dict], cold: float, timeout: float) -> str:
    """The printed table of `summarise`'s rows."""

    def fmt(v):
        return "-" if v is None else f"{v:.1f}"

    head = (f"{'kind':<17}{'inj':>4}{'recov':>6}{'rep':>5}{'in time':>8}{'lost':>5}{'hangs':>6}"
            f"{'recover s':>10}{'(max)':>7}{'report s':>9}{'survivors naming':>18}")
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['kind']:<17}{r['injected']:>4}{r['recovered']:>6}{r['reported']:>5}{r['in_time']:>8}"
                   f"{r['lost_updates']:>5}{r['hangs']:>6}{fmt(r['recover_s_median']):>10}{fmt(r['recover_s_max']):>7}"
                   f"{fmt(r['report_s_median']):>9}{r['survivors_naming']:>10}/{r['survivors_total']:<7}")
    out.append(f"cold start (launch to first commit), median: {cold:.1f} s; peer timeout {timeout:g} s; "
               "'in time' = recovered or reported within timeout + 5 s")
    return "\n".join(out)


def plot(faults: list, kinds, cold: float, timeout: float, path: Path) -> None:
    """Seconds from each fault to recovery and to the report, per kind, beside the cold start."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    kinds = [k for k in kinds if any(f.kind == k for f in faults)]
    for i, k in enumerate(kinds):
        rec = [f.recover_s for f in faults if f.kind == k and f.recover_s is not None]
        rep = [f.report_s for f in faults if f.kind == k and f.report_s is not None]
        ax.scatter([i - 0.12] * len(rec), rec, color="tab:blue", s=18, label="recovered" if i == 0 else None)
        ax.scatter([i + 0.12] * len(rep), rep, color="tab:orange", marker="x", s=22,
                   label="reported" if i == 0 else None)
    ax.axhline(cold, color="tab:green", ls="--", label=f"cold start {cold:.1f} s")
    ax.axhline(timeout, color="grey", ls=":", label=f"peer timeout {timeout:g} s")
    ax.set_xticks(range(len(kinds)), kinds, rotation=25, ha="right")
    ax.set_ylabel("seconds after the fault")
    ax.set_title("hetrain fault campaign: digits demo, 3 workers + 1 CPU machine, netns links")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
