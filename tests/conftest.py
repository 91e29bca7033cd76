import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .helpers import SCRIPTS, small_cluster


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
