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


def test_bundles_per_machine_and_unknown_gpu_type():
    from hetrain.cluster.spec import parse_cluster
    from hetrain.errors import UserError
    from hetrain.runtime.ray_backend import RayOptions, machine_bundles

    cluster = parse_cluster({"machines": [_gpu("g0"), _gpu("g1", "gpu"), {"name": "c0", "role": "cpu"},
                                          {"name": "w2", "role": "worker", "device": {"kind": "cpu"}}]})
    have = {"CPU": 8, GPU: 4, "accelerator_type:V100": 1}
    opts = RayOptions(gpu_resource=GPU, cpus_per_process=0.5)
    bundles, index = machine_bundles(cluster, "byteps", opts, have)
    # workers + co-located servers share their machine's bundle; the CPU machine gets a CPU bundle
    assert bundles[index["g0"]] == {"CPU": 1.0, GPU: 1.0, "accelerator_type:V100": 0.001}
    assert bundles[index["g1"]] == {"CPU": 1.0, GPU: 1.0}          # kind gpu: any GPU type
    assert bundles[index["c0"]] == {"CPU": 0.5}
    assert bundles[index["w2"]] == {"CPU": 1.0}                    # a CPU worker takes no GPU
    allreduce, index = machine_bundles(cluster, "allreduce", opts, have)
    assert "c0" not in index and len(allreduce) == 3               # no server: no bundle
    with pytest.raises(UserError, match="accelerator_type:A100"):
        machine_bundles(parse_cluster({"machines": [_gpu("g0", "a100")]}), "allreduce", opts, have)
    with pytest.raises(UserError, match="Ray Client"):
        RayOptions(address="ray://head:10001")


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


@pytest.mark.slow
def test_scheduler_resizes_a_job_across_nodes_and_it_equals_an_uninterrupted_run(ray_cluster, tmp_path):
    import signal

    import torch

    from hetrain.sched.executor import Backend, RealJobSpec, compare
    from hetrain.sched.worker import main as worker_main

    backend = Backend("ray", address=ray_cluster.address, gpu_resource=GPU, cpus_per_process=0.5)
    # the two V100s are on two nodes: `a` starts on both, shrinks to one when `b` arrives, grows back
    specs = [RealJobSpec("a", 0.0, 14, 0.3, seed=1), RealJobSpec("b", 1.0, 4, 0.2, seed=2)]
    log = []
    out = compare("v100:2", "doubling", tmp_path, specs=specs, backend=backend, log=log.append)
    real = out["real"]
    assert real["backend"] == "ray" and set(real["jct_s"]) == {"a", "b"}, log
    assert real["restarts"] >= 1 and len(real["restart_costs_s"]) == real["restarts"], log
    assert any("job a: 2 v100 -> 1 v100" in line for line in log), log
    assert {(r["job"], r["gpus"]) for r in real["step_times"]} >= {("a", 1)}, real["step_times"]
    assert out["sim_s"] > 0 and out["restart_s"] > 0
    # the job stopped, resized and restarted on Ray ends where an uninterrupted run ends
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        for s in specs:
            ref = tmp_path / f"ref-{s.name}"
            ref.mkdir()
            assert worker_main(["--job-dir", str(ref), "--steps", str(s.steps), "--seed", str(s.seed)]) == 0
            a = torch.load(ref / "checkpoint.pt", weights_only=True)
            b = torch.load(tmp_path / s.name / "checkpoint.pt", weights_only=True)
            assert b["done"] and b["step"] == a["step"] == s.steps
            for k in a["model"]:
                torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-5, atol=1e-6)
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)
