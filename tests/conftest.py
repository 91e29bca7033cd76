import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SCRIPTS = Path(__file__).parent / "scripts"


def small_cluster(workers: int = 2, cpus: int = 1, **network) -> dict:
    speeds = [1.0, 0.5, 1.0, 0.5]
    return {
        "name": "test",
        "machines": [{"name": f"w{i}", "role": "worker", "device": {"speed": speeds[i % 4]}} for i in range(workers)]
        + [{"name": f"c{j}", "role": "cpu"} for j in range(cpus)],
        **({"network": network} if network else {}),
    }


@pytest.fixture
def launch(tmp_path):
    """Run `hetrain launch` in a real subprocess; returns (returncode, output, run_dir)."""

    def _run(script: str, *args: str, cluster: dict | None = None, mode: str = "byteps", timeout: float = 20,
             extra: tuple[str, ...] = (), limit: float = 240):
        cfile = tmp_path / "cluster.yaml"
        cfile.write_text(yaml.safe_dump(cluster or small_cluster()))
        run_dir = tmp_path / f"run-{mode}"
        cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", mode,
               "--timeout", str(timeout), "--run-dir", str(run_dir), *extra, str(SCRIPTS / script), *args]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
        return proc.returncode, proc.stdout + proc.stderr, run_dir

    return _run
