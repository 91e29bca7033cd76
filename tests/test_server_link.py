"""Workers and summation servers on one host exchange partitions through shared memory
(comm/shm/channel.py), and the results are bit for bit those of gloo over loopback
(`--server-link gloo`), with odd sizes, fp32 and fp16, sums and weighted averages (real
processes, the launcher)."""
import re

import pytest
import torch

from hetrain.runtime.shmnames import job_segments
from tests.helpers import small_cluster


@pytest.mark.slow
@pytest.mark.parametrize("mode,servers", [("byteps", 2)])
def test_shared_memory_to_the_servers_gives_gloos_results(launch, tmp_path, mode, servers):
    """Two workers and two servers (byteps: each worker's own partitions too): every
    result bit for bit gloo's. (ps with one server over shared memory: the modes test
    against one process, tests/test_push_pull_modes.py, and the killed-peer test below.)"""
    got = {}
    for link in ("auto", "gloo"):
        out = tmp_path / link
        rc, log, _ = launch("server_link.py", str(out), mode=mode, cluster=small_cluster(workers=2, cpus=servers),
                            extra=("--partition-bytes", "65536", "--server-link", link))
        assert rc == 0, log
        assert log.count("server-link ok on rank") == 2, log
        if link == "auto":  # every worker reached every server (all on this host) through shared memory
            assert log.count(f"{servers} shared-memory channels") == 2, log
        else:
            assert log.count("0 shared-memory channels") == 2, log
        got[link] = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for r in range(2):
        for key, want in got["gloo"][r].items():
            assert torch.equal(got["auto"][r][key], want), f"{mode} rank {r} {key}"


@pytest.mark.slow
def test_a_worker_killed_mid_exchange_is_named_by_its_server_and_leaves_no_segment(launch):
    """die_mid_push.py: rank 1 is SIGKILLed in the middle of a step while its server waits
    for its partitions over shared memory; the server names it (PeerLostError from the
    shared-memory wait), nothing hangs (limit 90 s, lost-peer timeout 20 s), and the job
    leaves nothing in /dev/shm."""
    rc, log, _ = launch("die_mid_push.py", mode="ps", cluster=small_cluster(workers=2, cpus=1), timeout=20, limit=90,
                        extra=("--partition-bytes", "65536"))
    assert rc != 0
    assert "rank 1 (worker on machine w1) failed (killed by SIGKILL)" in log, log
    server = [line for line in log.splitlines() if line.startswith("[2:")]
    assert any("PeerLostError" in line and "lost rank 1 (worker on machine w1)" in line and "ShmPeerError" in line
               for line in server), log
    assert "unreachable" not in log
    job = re.search(r"hetrain: job (\S+),", log).group(1)
    assert job_segments(job) == [], f"job {job} left {job_segments(job)}"
