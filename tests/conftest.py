import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .helpers import SCRIPTS, small_cluster


def pytest_addoption(parser):
    parser.addoption("--cuda-sanitizer", action="store_true",
                     help="run under PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1): in this process and in "
                          "every process a test launches; e.g. `python -m pytest -m gpu --cuda-sanitizer`")


def pytest_configure(config):
    """--cuda-sanitizer: every process the tests start inherits TORCH_CUDA_SANITIZER=1 (torch
    reads it at import and checks each kernel's stream accesses); this one turns it on now
    (torch is already imported here)."""
    if config.getoption("--cuda-sanitizer"):
        os.environ["TORCH_CUDA_SANITIZER"] = "1"
        import torch

        if torch.cuda.is_available():
            from torch.cuda import _sanitizer

            _sanitizer.enable_cuda_sanitizer()


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
