"""Two machines: two network namespaces, each running `hetrain launch` with its node
rank and the master's address, train the demo together."""
import random
import subprocess
import sys

import pytest
import yaml

from hetrain.cluster import parse_cluster
from hetrain.cluster.netns import NetnsCluster, netns_available
from tests.helpers import repo_env

REASON = netns_available()


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(REASON is not None, reason=f"cannot create network namespaces here: {REASON}")
def test_two_node_launch_trains_the_demo(tmp_path):
    hosts = parse_cluster({"machines": [{"name": "hostA", "role": "worker", "device": {}, "bandwidth": "1gbit"},
                                        {"name": "hostB", "role": "worker", "device": {}, "bandwidth": "1gbit"}],
                           "network": {"mtu": 9000}})
    with NetnsCluster(hosts) as net:
        net.up()
        links = subprocess.run(["ip", "-n", net.namespaces["hostA"], "-o", "link"], capture_output=True, text=True).stdout
        assert "mtu 9000" in links, links  # network.mtu reaches the emulated links
        a, b = net.addresses["hostA"], net.addresses["hostB"]
        cluster = {"name": "two-nodes", "machines": [
            {"name": "w0", "role": "worker", "device": {"speed": 1.0}, "address": a, "node": 0},
            {"name": "w1", "role": "worker", "device": {"speed": 0.5}, "address": b, "node": 1},
            {"name": "c0", "role": "cpu", "address": b, "node": 1}]}
        cfile = tmp_path / "two.yaml"
        cfile.write_text(yaml.safe_dump(cluster))
        port = str(random.randint(20000, 40000))
        env = repo_env(HETRAIN_SECRET="two-node-test-secret-0001")
        procs = []
        for node, host in ((0, "hostA"), (1, "hostB")):
            cmd = net.wrap(host, [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile),
                                  "--node-rank", str(node), "--master-addr", a, "--master-port", port,
                                  "--timeout", "30", "--run-dir", str(tmp_path / f"node{node}"),
                                  "-m", "hetrain.demo.digits", "--epochs", "4"])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(outs)
    assert "digits demo: test accuracy" in outs[0]
    summary = yaml.safe_load((tmp_path / "node0" / "summary.json").read_text())
    assert set(summary["ranks"]) == {"w0", "w1"}
    assert summary["ranks"]["w1"]["samples"] > 0 and summary["accuracy"] > 0.85
