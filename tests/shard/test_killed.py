"""A worker of a sharded job SIGKILLed mid-step: the launcher restarts the job, every
worker reloads its spans from the last sharded commit, and the job ends with the
parameters of an uninterrupted run (nothing lost)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import ROOT, repo_env
from tests.shard.procs import reference

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param("killed.py", marks=pytest.mark.long), "elastic_killed.py"])
def test_sigkilled_worker_recovers_from_the_last_sharded_commit(script, tmp_path):
    """killed.py saves and loads the shards itself (`pytest -m long`: the same recovery
    as the elastic one, by hand); elastic_killed.py commits them through
    hetrain.elastic.State and resumes with @hetrain.elastic.run."""
    cluster = {"name": "t", "machines": [{"name": f"w{i}", "role": "worker", "device": {"speed": 1.0}}
                                         for i in range(3)]}
    cfile = tmp_path / "c.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    out = tmp_path / "params.json"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "allreduce",
           "--max-restarts", "1", "--run-dir", str(tmp_path / "run"), str(SCRIPTS / script), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=repo_env(ROOT), cwd=ROOT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "killed by SIGKILL" in log, log[-4000:]
    assert "round 1 starts at step 4" in log, log[-4000:]
    got = json.loads(out.read_text())
    for a, b in zip(got, reference(8, 12)):
        torch.testing.assert_close(torch.tensor(a), b.reshape(-1), rtol=1e-5, atol=1e-6)
