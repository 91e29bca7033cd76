"""Emulated links and devices end to end, in a job started by the launcher: what the
rate limiter and the emulated device recorded, and lower bounds on the time they took
(a sleep never ends early, so these hold on a loaded host)."""
import pytest
import torch

from tests.helpers import small_cluster

STEPS, NUMEL = 4, 100_000


@pytest.mark.slow
def test_ratelimited_uplinks_and_device_speeds(launch, tmp_path):
    cluster = small_cluster(workers=2, cpus=1, emulate="ratelimit")
    for m in cluster["machines"]:
        m["bandwidth"] = "16mbit"  # 2 MB/s: 1.6 MB per worker takes >= 0.77 s
    out = tmp_path / "res"
    rc, log, _ = launch("shaped.py", str(out), str(STEPS), str(NUMEL), cluster=cluster, mode="ps")
    assert rc == 0, log
    for r, speed in enumerate([1.0, 0.5]):  # small_cluster's device speeds
        got = torch.load(out / f"rank{r}.pt")
        # mode ps: every partition goes to the CPU machine, so every gradient byte is paced
        assert got["consumed"] == STEPS * NUMEL * 4, got
        assert got["rate"] == pytest.approx(2e6)
        assert got["elapsed"] >= (got["consumed"] - got["burst"]) / got["rate"], got
        # device speed s: the emulated device sleeps (1/s - 1) x the real compute
        assert got["speed"] == speed
        assert got["slept_s"] == pytest.approx(got["real_s"] * (1 / speed - 1), rel=1e-9, abs=1e-12), got
        assert got["wall_s"] >= got["real_s"] / speed, got


RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while n < int(sys.argv[2]):
    b = c.recv(1 << 16)
    if not b:
        break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def _tbf_sent_bytes(cmd_prefix: list[str], dev: str) -> int:
    import re
    import subprocess

    out = subprocess.run([*cmd_prefix, "tc", "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    tbf = out[out.index("qdisc tbf"):]
    return int(re.search(r"Sent (\d+) bytes", tbf).group(1))


@pytest.mark.slow
@pytest.mark.netns
def test_netns_links_are_shaped_to_their_bandwidth():
    """Two namespaces joined by tbf-shaped links at 20 Mbit/s: 2 MB take at least
    (2 MB - burst) / 2.5 MB/s, and the sender's shaper saw every byte."""
    import subprocess
    import sys

    from hetrain.cluster import parse_cluster
    from hetrain.cluster.netns import NetnsCluster, netns_available

    reason = netns_available()
    if reason is not None:
        pytest.skip(f"cannot create network namespaces here: {reason}")
    nbytes, rate = 2_000_000, 20e6 / 8
    cluster = parse_cluster({"machines": [{"name": n, "role": "worker", "device": {}, "bandwidth": "20mbit"}
                                          for n in ("a", "b")]})
    with NetnsCluster(cluster) as net:
        net.up()
        recv = subprocess.Popen(net.wrap("b", [sys.executable, "-c", RECEIVER, net.addresses["b"], str(nbytes)]),
                                stdout=subprocess.PIPE, text=True)
        port = recv.stdout.readline().strip()
        subprocess.run(net.wrap("a", [sys.executable, "-c", SENDER, net.addresses["b"], port, str(nbytes)]),
                       check=True, timeout=60)
        got, seconds = recv.communicate(timeout=60)[0].split()
        inner = next(d for d in subprocess.run(["ip", "-n", net.namespaces["a"], "-o", "link"], capture_output=True,
                                               text=True).stdout.split() if d.startswith("hv"))
        sent = _tbf_sent_bytes(["ip", "netns", "exec", net.namespaces["a"]], inner.split("@")[0].rstrip(":"))
    assert int(got) == nbytes
    burst = max(64 * 1024, rate / 250)
    assert float(seconds) >= (nbytes - burst) / rate, seconds  # the link carried no more than its rate
    assert sent >= nbytes  # every payload byte went through a's uplink shaper (plus headers)
