"""Workers and summation servers on one host exchange partitions through shared memory
(comm/shm/channel.py), and the results are bit for bit those of gloo over loopback
(`--server-link gloo`), with odd sizes, fp32 and fp16, sums and weighted averages (real
processes, the launcher)."""
import pytest
import torch

from tests.helpers import small_cluster


@pytest.mark.slow
@pytest.mark.parametrize("mode,servers", [("ps", 1), ("byteps", 2)])
def test_shared_memory_to_the_servers_gives_gloos_results(launch, tmp_path, mode, servers):
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
