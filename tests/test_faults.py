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


@pytest.mark.slow
def test_exception_on_one_rank_ends_the_job_and_names_it(launch):
    # limit=60 is the hang detector: a rank that took a last barrier at exit would wait for
    # its peers (stuck in push_pull, waiting for it) until the 80 s operation timeout
    rc, log, _ = launch("raise_mid_step.py", cluster=small_cluster(workers=3, cpus=1), timeout=20, limit=60)
    assert rc != 0
    assert "ValueError: bad batch on rank 1" in log
    assert "rank 1 (worker on machine w1) failed (exit code 1)" in log, log
    assert "leaving the job" not in log  # it did not wait for the others on its way out
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


# hung (SIGSTOP) workers and servers: tests/test_elastic_faults.py
