"""What the two-worker micro-benchmarks share (`bench/gloo_thread.py`, `bench/pair_swap.py`):
their flags, the two-core check, and launching the script itself as the worker of an
all-reduce job on two workers pinned to a core each (`threads: 1`), through `hetrain
launch` so `init()` sets the job up as in training. Also `repo_env`, the environment every
bench script gives the processes it launches."""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]


def pythonpath(*front) -> str:
    """PYTHONPATH for a launched process: `front` paths, the repository root, then the
    caller's own PYTHONPATH (os.pathsep-joined, no empty or repeated entries)."""
    old = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(str(p) for p in (*front, ROOT, *old) if str(p)))


def repo_env(*front, **extra) -> dict:
    """`dict(os.environ, **extra)` for a process a bench or a test launches, with this tree
    importable: `pythonpath(*front)`. Prepending, not replacing, matters where the
    dependencies are installed in a folder reached only through PYTHONPATH (`pip install
    --target DIR`, PYTHONPATH=DIR): a replaced PYTHONPATH leaves every launched process
    without them. (The tests use these too, through tests/helpers.py.)"""
    return dict(os.environ, **extra, PYTHONPATH=pythonpath(*front))


def start(doc: str, quick_help: str, worker: Callable[[str, int], None], script: str) -> argparse.Namespace | int:
    """Parse --quick and --json (and the launched worker's hidden --worker, --out,
    --repeats). In a launched worker, run `worker(out, repeats)` and return 0; on a host
    without 2 cores say so and return 2; else return the flags for the driver."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.out, a.repeats)
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        print(f"{script} needs 2 cores (a core per worker)", file=sys.stderr)
        return 2
    return a


@functools.lru_cache(maxsize=1)
def _operands():
    import torch

    return torch.randn(256, 512), torch.randn(512, 512)


def busy(ms: float) -> None:
    """Matrix products for `ms` milliseconds on this worker's core (as a backward would)."""
    a, w = _operands()
    t = time.perf_counter()
    while time.perf_counter() - t < ms / 1e3:
        a @ w


def launch(script: str, tmp: Path, tag: str, repeats: int, flags: tuple[str, ...] = ()) -> dict:
    """Run `script --worker` on the two pinned workers; returns the JSON it writes."""
    cluster = {"name": "pinned-pair", "machines": [{"name": f"w{i}", "role": "worker", "device": {}, "threads": 1}
                                                   for i in range(2)]}
    cfile = tmp / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    out = tmp / f"{tag}.json"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--quiet", "--cluster", str(cfile), "--mode", "allreduce",
           *flags, "--run-dir", str(tmp / f"run-{tag}"), str(Path(script).resolve()), "--worker", "--out", str(out),
           "--repeats", str(repeats)]
    subprocess.run(cmd, check=True, env=repo_env(), timeout=600)
    return json.loads(out.read_text())


def launches(script: str, count: int, repeats: int, variants: dict[str, tuple[str, ...]]) -> dict[str, list[dict]]:
    """`count` launches of each variant (its extra `hetrain launch` flags), taking turns A B
    A B so that a host whose speed drifts slows every variant alike; each variant's JSONs."""
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix=Path(script).stem + "-") as d:
        for k in range(count):
            for name, flags in variants.items():
                runs[name].append(launch(script, Path(d), f"{name}-{k}", repeats, flags))
                print(f"  [{name} launch {k + 1}/{count}]", flush=True)
    return runs


def write(path: str | None, out: dict) -> None:
    """The results as JSON, where `--json` asked for them."""
    if path:
        Path(path).write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")
