"""Launched jobs whose workers share this host: the all-reduce transport picks shared
memory by itself, training gives the single-process result as gloo did, a SIGKILLed
worker is named by the others, and no segment is left in /dev/shm."""
import re
import sys

import pytest
import torch

from hetrain.runtime.shmnames import job_segments
from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
from reference import single_process  # noqa: E402


def _left(log: str) -> list:
    """What the launched job (its id as the launcher prints it) left in /dev/shm; other
    tests' jobs may hold theirs meanwhile."""
    return job_segments(re.search(r"hetrain: job (\S+),", log).group(1))


@pytest.mark.slow
def test_allreduce_job_on_one_host_uses_shared_memory_and_matches_one_process(launch, tmp_path):
    out = tmp_path / "params"
    rc, log, _ = launch("equiv_train.py", str(out), "--show-collective", mode="allreduce",
                        cluster=small_cluster(workers=3, cpus=0))
    assert rc == 0, log
    for r in range(3):
        assert f"rank {r} collective ShmCollective buckets in shared memory" in log, log
    ref = single_process()
    for r in range(3):
        got = torch.load(out / f"rank{r}.pt")
        for name, want in ref.items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
    assert _left(log) == []


@pytest.mark.slow
def test_emulated_links_keep_gloo(launch, tmp_path):
    """Machines behind emulated links stand for hosts of their own: no shared memory."""
    out = tmp_path / "params"
    rc, log, _ = launch("equiv_train.py", str(out), "--show-collective", mode="allreduce",
                        cluster=small_cluster(workers=2, cpus=0, emulate="ratelimit"))
    assert rc == 0, log
    assert log.count("collective ProcessGroupCollective") == 2, log


@pytest.mark.slow
def test_killed_worker_is_named_over_shared_memory(launch):
    rc, log, _ = launch("die.py", cluster=small_cluster(workers=3, cpus=0), mode="allreduce", timeout=20, limit=90)
    assert rc != 0
    assert "rank 1 (worker on machine w1) failed (killed by SIGKILL)" in log
    survivors = [line for line in log.splitlines() if "PeerLostError" in line and "lost rank 1 (worker on machine w1)" in line]
    assert survivors, log
    assert "unreachable" not in log
    assert _left(log) == []
