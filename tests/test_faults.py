"""Bad input and lost peers: clear errors on every rank, and nothing hangs."""
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.helpers import small_cluster
from hetrain.runtime.auth import AuthError, admit


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["byteps", "allreduce"])
def test_mismatched_tensors_named_on_every_rank(launch, mode):
    rc, log, _ = launch("mismatch.py", mode=mode)
    assert rc != 0
    msg = "tensor 'b' has shape (3,) on rank(s) [0]; shape (4,) on rank(s) [1]"
    # each rank's own output lines carry its "[rank:machine/role]" prefix; the launcher's
    # replay of the failed rank's last lines at the end does not, so it cannot stand in
    # for a rank that stayed silent
    own = {r: [line for line in log.splitlines() if line.startswith(f"[{r}:")] for r in range(5)}
    for r in (0, 1):  # both workers say it
        assert any(msg in line for line in own[r]), (r, log)
    assert "unreachable" not in log
    if mode == "byteps":  # and the summation servers (ranks 2, 3, 4)
        assert any(msg in line for r in (2, 3, 4) for line in own[r]), log


@pytest.mark.slow
def test_killed_worker_is_named_and_nothing_hangs(launch):
    # limit=60 is the hang detector: the lost-peer timeout is 20 s
    rc, log, _ = launch("die.py", cluster=small_cluster(workers=3, cpus=1), timeout=20, limit=90)
    assert rc != 0
    assert "rank 1 (worker on machine w1) failed (killed by SIGKILL)" in log
    survivors = [line for line in log.splitlines() if "PeerLostError" in line and "lost rank 1 (worker on machine w1)" in line]
    assert survivors, log
    assert "unreachable" not in log


def test_wrong_secret_is_refused():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store.set("hetrain/nonce", "n0")
    errors = {}

    def join(rank, secret):
        try:
            admit(dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10)),
                  secret, rank, 2, 5)
        except AuthError as err:
            errors[rank] = str(err)

    threads = [threading.Thread(target=join, args=(0, "good-secret-0123456")),
               threading.Thread(target=join, args=(1, "wrong-secret-987654"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert "rank 1 did not present this job's shared secret" in errors[0]
    assert "rank 0 did not present" in errors[1]


@pytest.mark.slow
def test_hung_server_is_named_after_the_timeout(tmp_path):
    """A server that stops answering (SIGSTOP) makes the workers fail within the timeout."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import yaml

    from tests.helpers import SCRIPTS

    cfile = tmp_path / "c.yaml"
    cfile.write_text(yaml.safe_dump(small_cluster(workers=2, cpus=1)))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "ps", "--timeout", "5",
           "--run-dir", str(run_dir), str(SCRIPTS / "steps.py")]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:  # wait until training runs
        lines.append(line)
        if "step 10" in line:
            break
    server = None
    for pid in filter(str.isdigit, os.listdir("/proc")):  # the job's server: rank 2, our run dir
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"HETRAIN_RUN_DIR={run_dir}".encode() in environ and b"HETRAIN_RANK=2" in environ:
            server = int(pid)
    assert server is not None, "".join(lines)
    os.kill(server, signal.SIGSTOP)
    try:
        out, _ = proc.communicate(timeout=90)  # the hang detector
    finally:
        try:
            os.kill(server, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = "".join(lines) + out
    assert proc.returncode != 0
    assert "lost rank 2 (server on machine c0)" in log and "stopped answering or died" in log, log
