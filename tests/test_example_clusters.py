"""The cluster files in examples/clusters/ load, say what their comments say, and the
GPU + CPU one trains on a host with CUDA."""
import json
import subprocess
import sys

import pytest
import torch

from hetrain.cluster.spec import load_cluster
from tests.helpers import ROOT, repo_env

CLUSTERS = ROOT / "examples" / "clusters"


def test_every_example_cluster_loads():
    names = sorted(p.name for p in CLUSTERS.glob("*.yaml"))
    assert names == ["gpu_cpu.yaml", "lab.yaml", "local.yaml", "two_nodes.yaml"]
    for path in CLUSTERS.glob("*.yaml"):
        load_cluster(path)


def test_the_example_clusters_are_what_they_say():
    local = load_cluster(CLUSTERS / "local.yaml")
    assert local.nnodes == 1 and [m.device.speed for m in local.workers] == [1.0, 1.0, 0.5, 0.25]
    assert len(local.cpu_machines) == 2
    two = load_cluster(CLUSTERS / "two_nodes.yaml")
    assert two.nnodes == 2 and {m.address for m in two.machines} == {"127.0.0.1"}
    assert {m.node for m in two.workers} == {0, 1}
    mixed = load_cluster(CLUSTERS / "gpu_cpu.yaml")
    assert [m.device.cuda for m in mixed.workers] == [True, False, False]
    assert [mixed.kind_of(m).device_class for m in mixed.workers] == ["gpu", "cpu", "cpu"]
    lab = load_cluster(CLUSTERS / "lab.yaml")
    assert lab.nnodes == 2 and all(k.price_per_hour for k in lab.kinds)


@pytest.mark.gpu
@pytest.mark.slow
def test_the_gpu_cpu_cluster_trains_on_the_gpu_and_the_cpus(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(CLUSTERS / "gpu_cpu.yaml"),
           "--run-dir", str(tmp_path / "run"), "-m", "hetrain.demo.digits", "--epochs", "3", "--cost-per-sample", "0"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=repo_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    devices = {name: r["device"] for name, r in summary["ranks"].items()}
    assert devices["gpu0"].startswith("cuda") and devices["cpu0"].startswith("cpu")
    assert all(r["samples"] > 0 for r in summary["ranks"].values())
