"""torch.distributed has no authentication, so every socket a job listens on must be
bound to the cluster's own address (here 127.0.0.1), never to all interfaces."""
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from tests.helpers import SCRIPTS, repo_env, small_cluster


def _descendants(pid: int) -> set[int]:
    out = {pid}
    for _ in range(4):
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid in out:
                out.add(int(p))
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2) to list listening sockets")
def test_job_listens_only_on_cluster_address(tmp_path):
    cfile = tmp_path / "c.yaml"
    cfile.write_text(yaml.safe_dump(small_cluster(workers=2, cpus=1)))
    env = repo_env()
    proc = subprocess.Popen([sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "byteps",
                             "--run-dir", str(tmp_path / "run"), str(SCRIPTS / "steps.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            if "step 10" in line:
                break
        pids = _descendants(proc.pid)
        assert len(pids) >= 5  # launcher + 2 workers + 3 servers (2 co-located + 1 CPU)
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
        ours = [line for line in listening if any(f"pid={p}," in line for p in pids)]
        assert ours, listening
        for line in ours:
            local = line.split()[3]
            assert re.match(r"^127\.0\.0\.1:\d+$", local), f"a job socket listens beyond the cluster address: {line}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
