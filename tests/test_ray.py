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

from tests.helpers import pythonpath, repo_env

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'hetrain[ray]')")
# one pytest worker runs every test here: they share the module's local Ray cluster, and
# two clusters started at once on one host would contend for its ports (README: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("ray")

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
GPU = "emu_gpu"


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pythonpath()  # Ray's processes (and so the ranks) import this tree
    small = {"object_store_memory": 75 * 2**20, "num_cpus": 2}
    # a dead node is noticed after ~3 missed 1 s health checks (Ray's default: 5 x 3 s)
    health = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    c = Cluster(initialize_head=True, head_node_args={**small, "resources": {GPU: 1, "accelerator_type:V100": 1},
                                                      "_system_config": health})
    c.add_node(**small, resources={GPU: 1, "accelerator_type:V100": 1})
    c.k80_node = c.add_node(**small, resources={GPU: 2, "accelerator_type:K80": 1})
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


def _launch(ray_cluster, tmp_path, machines, script_args, mode="allreduce"):
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump({"name": "t", "machines": machines}))
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--ray", ray_cluster.address, "--ray-gpu-resource", GPU,
           "--ray-cpus", "0.5", "--cluster", str(cfile), "--mode", mode, "--timeout", "20",
           "--run-dir", str(tmp_path / "run"), *script_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=repo_env())


def _committed(job_dir: Path) -> dict:
    """A scheduler job's last commit, flattened: step, done and the model's state_dict."""
    from hetrain.train.elastic import load_committed

    c = load_committed(job_dir / "elastic")
    return {**c["values"], "model": c["objects"]["model"]}


def _gpu(name, kind="v100"):
    return {"name": name, "role": "worker", "device": {"kind": kind}}


@pytest.mark.slow
def test_ranks_land_on_different_nodes_with_a_cpu_server(ray_cluster, tmp_path):
    # two V100 workers (one V100 per node) and a CPU machine whose summation server takes a CPU bundle
    machines = [_gpu("g0"), _gpu("g1"), {"name": "c0", "role": "cpu"}]
    p = _launch(ray_cluster, tmp_path, machines, [str(SCRIPTS / "ray_probe.py")], mode="ps")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out
    raylets = dict(re.findall(r"^\[(\d):g\d/w\d\] probe rank \d of 2 raylet (\d+) sum ok$", out, re.M))
    assert set(raylets) == {"0", "1"}, out          # output streams back with rank prefixes
    assert raylets["0"] != raylets["1"], out        # one V100 per node: the ranks are on two nodes
    assert "3 bundles on" in out and "2 workers + 1 summation servers" in out, out
    assert "all 3 processes finished" in out, out


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
def test_scheduler_resizes_a_job_across_nodes_and_it_equals_an_uninterrupted_run(ray_cluster, tmp_path):
    import signal

    import torch

    from hetrain.sched.executor import Backend, compare
    from hetrain.sched.job import RealJobSpec
    from hetrain.sched.job import Alloc
    from hetrain.sched.worker import main as worker_main

    def grow_once_running(jobs, cluster, allocation, now):
        """One V100 until the job has made progress, then both (one per node): a resize
        of a running job, decided at a round boundary whatever the host's speed."""
        (job,) = jobs
        return {job.job_id: Alloc(0, 2 if job.remaining < job.work else 1)}

    grow_once_running.round_s = 1.0
    backend = Backend("ray", address=ray_cluster.address, gpu_resource=GPU, cpus_per_process=0.5)
    spec = RealJobSpec("a", 0.0, 16, 0.3, seed=1)
    log = []
    out = compare("v100:2", grow_once_running, tmp_path, specs=[spec], backend=backend, log=log.append)
    real = out["real"]
    assert real["backend"] == "ray" and real["restarts"] == 1 and len(real["restart_costs_s"]) == 1, log
    assert any("job a: 1 v100 -> 2 v100 (stop/restart)" in line for line in log), log
    placed = (tmp_path / "a" / "launcher.log").read_text()
    assert "1 bundles on 1 node(s)" in placed and "2 bundles on 2 node(s)" in placed, placed
    assert {(r["gpus"]) for r in real["step_times"]} == {1, 2}, real["step_times"]
    assert out["sim_s"] > 0 and out["restart_s"] > 0
    # the job stopped on one node and restarted on two ends where an uninterrupted run ends
    ref = tmp_path / "ref"
    ref.mkdir()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        assert worker_main(["--job-dir", str(ref), "--steps", str(spec.steps), "--seed", str(spec.seed)]) == 0
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)
    a, b = _committed(ref), _committed(tmp_path / "a")
    assert b["done"] and b["step"] == a["step"] == spec.steps
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_node_removed_mid_job_is_reported_as_a_lost_peer(ray_cluster, tmp_path):
    # rank 1 lands on the K80 node, which then goes away (last test of the module: no other needs it)
    doomed = ray_cluster.k80_node
    p = _launch(ray_cluster, tmp_path, [_gpu("g0"), _gpu("g1", "k80")],
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
