import os
import subprocess
import sys

import pytest
import yaml

from .helpers import SCRIPTS, repo_env, small_cluster


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


def run_launcher(cmd: list[str], env: dict, limit: float) -> tuple[int, str]:
    """Run a `hetrain launch` command; past `limit` seconds, stop it as a user would (SIGTERM:
    the launcher stops its processes, which run in sessions of their own), then kill it,
    so no worker outlives a timed-out test and takes the cores from the rest of the suite."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return proc.returncode, out


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
        env = repo_env()
        return_code, out = run_launcher(cmd, env, limit)
        return return_code, out, run_dir

    return _run
