"""Launching inside an allocation: Slurm's host lists, the node count, rank and master
from `SLURM_*`, torchrun's `PET_*` (Kubeflow TrainJob / PyTorchJob) and a PyTorchJob's
plain variables; flags win over the environment; two launchers started with only the
environment train the demo."""
import os
import subprocess
import sys

import pytest

from hetrain.errors import UserError
from hetrain.runtime.allocation import apply, detect, expand_hostlist
from hetrain.runtime.torchrun import TorchrunFlags
from tests.helpers import ROOT, free_port, repo_env


@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2]-b,c", ["a1-b", "a2-b", "c"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu[8-10],cpu[001-002]", ["gpu8", "gpu9", "gpu10", "cpu001", "cpu002"]),
    ("x[9-11]", ["x9", "x10", "x11"]),
])
def test_slurm_host_lists_expand(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-03", "node]1[", "node[a-b]", "node[3-1]"])
def test_a_broken_host_list_says_what_to_write(text):
    with pytest.raises(UserError, match="host list"):
        expand_hostlist(text)


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_NUM_NODES": "3", "SLURM_NODEID": "2",
         "SLURM_STEP_NUM_TASKS": "3", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_STEP_NODELIST": "gpu[07-09]"}


def test_a_slurm_step_gives_nodes_rank_and_master():
    alloc = detect(SLURM)
    assert (alloc.source, alloc.nnodes, alloc.node_rank, alloc.master_addr, alloc.master_port) == \
        ("Slurm", 3, 2, "gpu07", 15000 + 4242)
    assert detect({**SLURM, "MASTER_PORT": "29511", "MASTER_ADDR": "10.1.2.3"}).master_port == 29511
    assert detect({**SLURM, "MASTER_ADDR": "10.1.2.3"}).master_addr == "10.1.2.3"


def test_slurm_outside_a_step_or_with_several_tasks_per_node_is_refused():
    batch = {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(UserError, match="srun --ntasks-per-node=1"):
        detect(batch)
    with pytest.raises(UserError, match="one launcher per node"):
        detect({**SLURM, "SLURM_STEP_NUM_TASKS": "12"})
    assert detect({**SLURM, "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_NUM_NODES": "1"}) is None  # one node: as before


def test_kubeflow_variables():
    pet = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400",
           "PET_NPROC_PER_NODE": "2"}
    alloc = detect(pet)
    assert (alloc.nnodes, alloc.node_rank, alloc.master_addr, alloc.master_port, alloc.nproc_per_node) == \
        (2, 1, "job-node-0-0.job", 29400, "2")
    old = {"MASTER_ADDR": "pytorchjob-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4", "RANK": "3"}
    alloc = detect(old)
    assert (alloc.source, alloc.nnodes, alloc.node_rank, alloc.master_port) == ("PyTorchJob", 4, 3, 23456)
    # what a launcher hands its own processes is not an allocation
    assert detect({**old, "LOCAL_RANK": "0"}) is None
    # PET_* is torchrun's own convention: it wins over Slurm
    assert detect({**SLURM, **pet}).source == "torchrun env (PET_*)"


def test_flags_win_over_the_environment():
    flags, alloc = apply(TorchrunFlags(node_rank=0, master_port=30000), SLURM)
    assert alloc.source == "Slurm"
    assert (flags.nnodes, flags.node_rank, flags.master_addr, flags.master_port) == (3, 0, "gpu07", 30000)
    flags, _ = apply(TorchrunFlags(rdzv_endpoint="10.0.0.5:29400"), SLURM)
    assert flags.master_addr is None and flags.master_port is None and flags.rdzv_endpoint == "10.0.0.5:29400"
    flags, alloc = apply(TorchrunFlags(standalone=True), SLURM)
    assert alloc is None and flags == TorchrunFlags(standalone=True)
    # with a cluster file, the file decides the processes per node
    flags, _ = apply(TorchrunFlags(), {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1",
                                       "PET_NPROC_PER_NODE": "3"}, cluster_file=True)
    assert flags.nproc_per_node is None and flags.nnodes == 2
    assert apply(TorchrunFlags(), {})[1] is None


def _clean_env() -> dict:
    env = repo_env()
    for key in list(env):
        if key.startswith(("SLURM_", "PET_")) or key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                          "LOCAL_RANK"):
            del env[key]
    env["HETRAIN_SECRET"] = "0123456789abcdef0123456789abcdef"
    return env


def _two_launchers(tmp_path, envs: list[dict]) -> list[tuple[int, str]]:
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(ROOT / "examples/clusters/two_nodes.yaml"),
           "--timeout", "30", "-m", "hetrain.demo.digits", "--epochs", "1"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env={**_clean_env(), **e}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for e in envs]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


@pytest.mark.slow
def test_two_launchers_in_a_slurm_step_train_the_demo(tmp_path):
    port = str(free_port())
    base = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
            "SLURM_STEP_NODELIST": "localhost,127.0.0.1", "MASTER_PORT": port}
    results = _two_launchers(tmp_path, [{**base, "SLURM_NODEID": "0"}, {**base, "SLURM_NODEID": "1"}])
    for rc, text in results:
        assert rc == 0, text
        assert "rendezvous from the environment (Slurm: node" in text
    assert "test accuracy" in results[0][1]


@pytest.mark.slow
def test_two_launchers_in_kubeflow_pods_train_the_demo(tmp_path):
    base = {"PET_NNODES": "2", "PET_MASTER_ADDR": "localhost", "PET_MASTER_PORT": str(free_port()),
            "PET_NPROC_PER_NODE": "1"}
    results = _two_launchers(tmp_path, [{**base, "PET_NODE_RANK": "0"}, {**base, "PET_NODE_RANK": "1"}])
    for rc, text in results:
        assert rc == 0, text
        assert "rendezvous from the environment (torchrun env (PET_*): node" in text
    assert "test accuracy" in results[0][1]


def test_a_cluster_file_that_disagrees_with_the_allocation_says_so(tmp_path, monkeypatch):
    from hetrain.cli import build_parser
    from hetrain.runtime.cli import launch_config

    for key in [k for k in os.environ if k.startswith(("SLURM_", "PET_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PET_NNODES", "3")
    monkeypatch.setenv("PET_NODE_RANK", "1")
    monkeypatch.setenv("PET_MASTER_ADDR", "127.0.0.1")
    cluster = str(ROOT / "examples/clusters/two_nodes.yaml")
    args = build_parser().parse_args(["launch", "--cluster", cluster, "x.py"])
    with pytest.raises(UserError, match="allocation has 3 nodes, but the cluster file puts its machines on 2"):
        launch_config(args, ["x.py"])
    monkeypatch.setenv("PET_NNODES", "2")
    cfg = launch_config(args, ["x.py"])
    assert (cfg.node_rank, cfg.master_addr, cfg.assign_node_rank) == (1, "127.0.0.1", False)
