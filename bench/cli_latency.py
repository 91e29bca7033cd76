"""How long `hetrain` takes to answer bad input, wall clock, beside what a Python start
and an `import torch` cost on the same host in the same run.

Each case runs `python -m hetrain.cli ARGS` in a fresh process (as a user's shell would
start `hetrain`), REPEATS times, cases interleaved so a host whose load drifts slows all
alike. Per case: median and worst wall seconds, the exit code (2 expected: a one-line
error) and whether torch was imported before the answer (read from `-X importtime` in a
separate run). The baselines are `python -c pass` (the floor) and `python -c "import
torch"` (what every answer cost when torch was imported before the arguments were
checked); `/torch` is a case's median over `import torch`'s, measured in the same passes,
so a loaded host shows the same ratio. Bar: every case's median under 1 s (a single
answer can stall behind the host's other work, as the `python -c pass` baseline's worst
shows on a shared machine; the worst is printed too).

    python bench/cli_latency.py [--quick] [--json bench/results/cli_latency.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BAR_S = 1.0


def _files(d: Path) -> dict[str, Path]:
    files = {
        "broken": "machines: [\n",
        "speed": "machines:\n  - {name: w0, role: worker, device: {kind: cpu, speed: 2.0}}\n",
        "unknown_key": "machines:\n  - {name: w0, role: worker, devise: {kind: cpu}}\n",
        "no_worker": "machines:\n  - {name: c0, role: cpu}\n",
        "script": "print('never run')\n",
    }
    out = {}
    for name, text in files.items():
        p = d / (f"{name}.py" if name == "script" else f"{name}.yaml")
        p.write_text(text)
        out[name] = p
    return out


def cases(f: dict[str, Path]) -> dict[str, list[str]]:
    s = str(f["script"])
    return {
        "launch --cluster broken.yaml": ["launch", "--cluster", str(f["broken"]), s],
        "launch --cluster (speed: 2.0)": ["launch", "--cluster", str(f["speed"]), s],
        "launch --cluster (unknown key)": ["launch", "--cluster", str(f["unknown_key"]), s],
        "launch --cluster (no worker)": ["launch", "--cluster", str(f["no_worker"]), s],
        "launch --cluster missing.yaml": ["launch", "--cluster", "missing.yaml", s],
        "launch missing script": ["launch", "--nproc-per-node", "2", "nosuch.py"],
        "launch -m missing module": ["launch", "-m", "no.such.module"],
        "launch --nnodes 2 (no master)": ["launch", "--nnodes", "2", s],
        "launch --timeout abc": ["launch", "--timeout", "abc", s],
        "launch --plan missing.json": ["launch", "--plan", "missing.json"],
        "demo --cluster broken.yaml": ["demo", "--cluster", str(f["broken"])],
        "demo --epochs x": ["demo", "--epochs", "x"],
        "plan --cluster broken.yaml": ["plan", "--model", "cnn", "--cluster", str(f["broken"])],
    }


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _time(argv: list[str], cwd: str) -> tuple[float, int, str]:
    t = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)
    return time.perf_counter() - t, proc.returncode, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


def _imports_torch(argv: list[str], cwd: str) -> bool:
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=120)
    return any(line.rstrip().endswith("| torch") for line in proc.stderr.splitlines())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    ap.add_argument("--json", default=str(REPO / "bench" / "results" / "cli_latency.json"))
    args = ap.parse_args()
    repeats = 3 if args.quick else 7
    with tempfile.TemporaryDirectory() as d:
        f = _files(Path(d))
        runs = {name: [sys.executable, "-m", "hetrain.cli", *a] for name, a in cases(f).items()}
        base = {"baseline: python -c pass": [sys.executable, "-c", "pass"],
                "baseline: python -c 'import torch'": [sys.executable, "-c", "import torch"]}
        times: dict[str, list[float]] = {k: [] for k in [*base, *runs]}
        rcs, msgs = {}, {}
        for _ in range(repeats):  # interleaved: every case once per pass
            for name, argv in {**base, **runs}.items():
                wall, rc, msg = _time(argv, d)
                times[name].append(wall)
                rcs[name], msgs[name] = rc, msg
        torch_seen = {name: _imports_torch(argv[1:], d) for name, argv in runs.items()}
    rows = []
    for name in times:
        is_case = name in runs
        rows.append({"case": name, "median_s": statistics.median(times[name]), "max_s": max(times[name]),
                     "exit": rcs[name], "torch_imported": torch_seen.get(name), "message": msgs[name] if is_case else "",
                     "under_bar": (statistics.median(times[name]) < BAR_S) if is_case else None})
    torch_s = statistics.median(times["baseline: python -c 'import torch'"])
    for r in rows:
        r["of_import_torch"] = r["median_s"] / torch_s  # side by side: what the answer cost before
    print(f"{'case':40} {'median s':>9} {'max s':>7} {'/torch':>7} {'exit':>5} {'torch':>6}  answer")
    for r in rows:
        torch_col = "" if r["torch_imported"] is None else ("yes" if r["torch_imported"] else "no")
        print(f"{r['case']:40} {r['median_s']:9.3f} {r['max_s']:7.3f} {r['of_import_torch']:7.2f} {r['exit']:5d} "
              f"{torch_col:>6}  {r['message'][:100]}")
    cases_rows = [r for r in rows if r["under_bar"] is not None]
    met = all(r["under_bar"] and r["exit"] == 2 and not r["torch_imported"] for r in cases_rows)
    worst = max(r["max_s"] for r in cases_rows)
    slowest = max(r["median_s"] for r in cases_rows)
    print(f"slowest median answer {slowest:.3f} s, worst single answer {worst:.3f} s (python -c pass: worst "
          f"{rows[0]['max_s']:.3f} s); bar: every median < {BAR_S} s, exit 2, torch not imported: "
          f"{'met' if met else 'NOT met'}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"repeats": repeats, "bar_s": BAR_S, "met": met, "worst_s": worst, "slowest_median_s": slowest,
                                           "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
