"""Helpers for the HeterPS runtime tests: hand-made plans and a `hetrain train` runner."""
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import repo_env

# ctr-small layers: 0-1 bottom MLP, 2-9 embedding lookups, 10 interaction, 11-13 top MLP
THREE_STAGES = [((0, 5), "cpu", "cpu", 1), ((5, 11), "gpu-k80", "gpu", 2), ((11, 14), "cpu", "cpu", 1)]


def make_plan(stages=THREE_STAGES, batch: int = 256) -> dict:
    """A plan JSON in `hetrain plan`'s format (the runtime reads layers, type, instances)."""
    return {"format": "hetrain.plan/1", "model": "ctr-small", "feasible": True, "target": 100.0,
            "batch_size": batch,
            "stages": [{"layers": list(l), "type": t, "kind": k, "instances": n} for l, t, k, n in stages]}


def train(tmp_path: Path, plan: dict, *args: str, name: str = "run", limit: float = 150):
    """Run `hetrain train` in a subprocess; returns (returncode, output, run_dir)."""
    pfile = tmp_path / "plan.json"
    pfile.write_text(json.dumps(plan))
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "hetrain.cli", "train", "--plan", str(pfile), "--run-dir", str(run_dir), *args]
    env = repo_env()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=tmp_path)
    return p.returncode, p.stdout + p.stderr, run_dir
