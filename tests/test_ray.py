"""hetrain on a Ray cluster: three Ray nodes on this host (`ray.cluster_utils.Cluster`),
GPUs declared as custom resource counts (`emu_gpu`, typed by `accelerator_type:*`).
One cluster is shared by the whole module (Ray's start-up is the expensive part)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'hetrain[ray]')")

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
GPU = "emu_gpu"


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO)  # Ray's processes (and so the ranks) import this tree
    small = {"object_store_memory": 75 * 2**20, "num_cpus": 2}
    # a dead node is noticed after ~3 missed 1 s health checks (Ray's default: 5 x 3 s)
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    c = Cluster(initialize_head=True, head_node_args={**small, "resources": {GPU: 1, "accelerator_type:V100": 1},
                                                      "_system_config": health})
    c.add_node(**small, resources={GPU: 1, "accelerator_type:V100": 1})
    c.add_node(**small, resources={GPU: 2, "accelerator_type:K80": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, logging_level="WARNING")
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _launch(ray_cluster, tmp_path, machines, script_args, mode="allreduce", timeout=240, wait=None):
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump({"name": "t", "machines": machines}))
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--ray", ray_cluster.address, "--ray-gpu-resource", GPU,
           "--ray-cpus", "0.5", "--cluster", str(cfile), "--mode", mode, "--timeout", "20",
           "--run-dir", str(tmp_path / "run"), *script_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))


def _gpu(name, kind="v100"):
    return {"name": name, "role": "worker", "device": {"kind": kind}}


@pytest.mark.slow
def test_ranks_land_on_different_nodes_with_cpu_servers(ray_cluster, tmp_path):
    # two V100 workers (one per V100 node) + a CPU machine, BytePS mode: co-located and CPU servers
    machines = [_gpu("g0"), _gpu("g1"), {"name": "c0", "role": "cpu"}]
    p = _launch(ray_cluster, tmp_path, machines, [str(SCRIPTS / "ray_probe.py")], mode="byteps")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out
    raylets = dict(re.findall(r"^\[(\d):g\d/w\d\] probe rank \d of 2 raylet (\d+) sum ok$", out, re.M))
    assert set(raylets) == {"0", "1"}, out          # output streams back with rank prefixes
    assert raylets["0"] != raylets["1"], out        # one V100 per node: the ranks are on two nodes
    assert "3 bundles on" in out and "2 workers + 3 summation servers" in out, out
    assert "all 5 processes finished" in out, out


@pytest.mark.slow
def test_unknown_gpu_type_is_a_clear_error(ray_cluster, tmp_path):
    p = _launch(ray_cluster, tmp_path, [_gpu("g0", "a100")], [str(SCRIPTS / "ray_probe.py")])
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 2, out
    assert "accelerator_type:A100" in out and "Traceback" not in out, out


@pytest.mark.slow
def test_node_removed_mid_job_is_reported_as_a_lost_peer(ray_cluster, tmp_path):
    # a fourth node, the only one with a P100: rank 1 lands there, and then the node goes away
    doomed = ray_cluster.add_node(num_cpus=1, object_store_memory=75 * 2**20,
                                  resources={GPU: 1, "accelerator_type:P100": 1})
    ray_cluster.wait_for_nodes()
    p = _launch(ray_cluster, tmp_path, [_gpu("g0"), _gpu("g1", "p100")],
                [str(SCRIPTS / "ray_probe.py"), "--steps", "100000", "--sleep", "0.05"])
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "[1:g1/w1] probe rank 1 step 1 done" in line:
            break
    else:
        pytest.fail("the job did not start:\n" + "".join(lines))
    ray_cluster.remove_node(doomed, allow_graceful=False)
    out = "".join(lines) + p.communicate(timeout=120)[0]
    assert p.returncode == 1, out
    assert re.search(r"rank 1 \(worker on machine g1\) failed \(its Ray actor on node \S+ was lost", out), out
    # the survivor stops with a lost-peer error, as in a local launch (it names rank 1 when Ray
    # reported the node dead before the survivor gave up waiting for the verdict)
    assert re.search(r"\[0:g0/w0\] .*PeerLostError: rank 0 \(worker on machine g0\): lost "
                     r"(rank 1 \(worker on machine g1\)|an unknown peer)", out), out
    assert "probe rank 0 finished" not in out
