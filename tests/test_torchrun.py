"""torchrun's conventions, in-process: flags -> cluster, the process environment,
joining a job plain torchrun started, cores for CPU workers, entry-point checks."""
import os
import subprocess
import sys

import numpy as np
import pytest

from hetrain.cli import build_parser
from hetrain.cluster import ClusterSpecError, parse_cluster
from hetrain.errors import UserError
from hetrain.runtime.cores import assign_cores, pin
from hetrain.runtime.env import ProcEnv
from hetrain.runtime.launch import check_entry_point
from hetrain.runtime.topology import build_topology
from hetrain.runtime.torchrun import (TorchrunFlags, from_torchrun_environ, parse_endpoint, parse_nnodes,
                                      parse_nproc, resolve)
from hetrain.perf.steptime import balanced_sizes
from hetrain.train.balance import BalanceConfig, memory_caps
from tests.helpers import SCRIPTS, small_cluster


# ---- flags -> cluster -------------------------------------------------------------------

def test_nnodes_nproc_without_a_cluster_file_is_a_workers_only_job():
    r = resolve(TorchrunFlags(nnodes=2, nproc_per_node=3, master_addr="127.0.0.1"), None, None)
    assert [m.name for m in r.cluster.machines] == ["w0", "w1", "w2", "w3", "w4", "w5"]
    assert [m.node for m in r.cluster.machines] == [0, 0, 0, 1, 1, 1]
    assert all(m.role == "worker" for m in r.cluster.machines)
    assert r.mode == "allreduce"
    assert r.assign_node_rank and r.node_rank is None  # no --node-rank: handed out at rendezvous
    assert (r.master_addr, r.master_port) == ("127.0.0.1", 29500)  # torchrun's default port
    topo = build_topology(r.cluster, r.mode)
    assert topo.world_size == 6 and not topo.servers


def test_mode_flag_overrides_the_allreduce_default():
    r = resolve(TorchrunFlags(nproc_per_node=2, node_rank=0), None, "colocated")
    assert r.mode == "colocated" and build_topology(r.cluster, r.mode).servers
    assert r.node_rank == 0 and not r.assign_node_rank


def test_standalone_is_one_node_on_a_free_port():
    r = resolve(TorchrunFlags(standalone=True, nproc_per_node=2), None, None)
    assert len(r.cluster.workers) == 2 and r.cluster.nnodes == 1
    assert (r.node_rank, r.master_addr, r.master_port) == (None, None, 0)


def test_no_torchrun_flags_keep_the_builtin_cluster():
    r = resolve(TorchrunFlags(), None, None)
    assert r.cluster.name == "default" and r.mode == "byteps"


def test_rdzv_endpoint_is_the_master():
    r = resolve(TorchrunFlags(nnodes=2, rdzv_endpoint="127.0.0.1:29611"), None, None)
    assert (r.master_addr, r.master_port) == ("127.0.0.1", 29611)
    assert parse_endpoint("10.0.0.1") == ("10.0.0.1", 29400)
    assert parse_endpoint("[::1]:7000") == ("::1", 7000)
    assert parse_endpoint("localhost:7000")[1] == 7000
    with pytest.raises(UserError, match="the port must be a number"):
        parse_endpoint("10.0.0.1:http")


def test_a_cluster_file_decides_and_agreeing_flags_are_accepted():
    cluster = parse_cluster(small_cluster(workers=2, cpus=1))
    r = resolve(TorchrunFlags(nnodes=1, nproc_per_node=2), cluster, None)
    assert r.cluster is cluster and r.mode == "byteps"


@pytest.mark.parametrize("flags, message", [
    (TorchrunFlags(nnodes=2), "--nnodes 2 contradicts the cluster file"),
    (TorchrunFlags(nproc_per_node=3), "--nproc-per-node 3 contradicts the cluster file, which has node 0: 2"),
])
def test_flags_that_contradict_a_cluster_file_are_refused(flags, message):
    with pytest.raises(UserError, match=message):
        resolve(flags, parse_cluster(small_cluster(workers=2, cpus=1)), None)


@pytest.mark.parametrize("flags, message", [
    (TorchrunFlags(standalone=True, nnodes=2), "--standalone runs one node"),
    (TorchrunFlags(standalone=True, master_port=1234), "--standalone picks its own"),
    (TorchrunFlags(nnodes=2, nproc_per_node=1), "needs the rendezvous host"),
    (TorchrunFlags(rdzv_endpoint="127.0.0.1:1", master_port=2), "name different ports"),
    (TorchrunFlags(nnodes=2, node_rank=2, master_addr="127.0.0.1"), "--node-rank 2 is outside 0..1"),
])
def test_inconsistent_torchrun_flags_are_refused(flags, message):
    with pytest.raises(UserError, match=message):
        resolve(flags, None, None)


def test_a_multi_node_cluster_file_without_node_rank_runs_every_node_here():
    data = small_cluster(workers=2, cpus=1)
    data["machines"][1]["node"] = 1
    r = resolve(TorchrunFlags(), parse_cluster(data), None)
    assert r.node_rank is None and not r.assign_node_rank


def test_nnodes_and_nproc_values():
    assert parse_nnodes("3") == 3 and parse_nnodes("2:2") == 2
    with pytest.raises(UserError, match="fixed number of nodes"):
        parse_nnodes("1:4")
    with pytest.raises(UserError, match="not a number of nodes"):
        parse_nnodes("two")
    assert parse_nproc("4") == 4
    assert parse_nproc("cpu") == len(os.sched_getaffinity(0))
    with pytest.raises(UserError, match="at least 1"):
        parse_nproc("0")


def test_torchrun_spellings_parse():
    args = build_parser().parse_args(
        ["launch", "--nnodes=1", "--nproc_per_node=2", "--node_rank", "0", "--master_addr", "127.0.0.1",
         "--master_port=29501", "--rdzv_backend", "c10d", "--rdzv_id", "job7", "train.py", "--lr", "0.1"])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("1", "2", 0)
    assert (args.master_addr, args.master_port, args.rdzv_id) == ("127.0.0.1", 29501, "job7")
    assert args.script == "train.py" and args.script_args == ["--lr", "0.1"]
    dashed = build_parser().parse_args(["launch", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1", "--standalone",
                                        "-m", "pkg.mod"])
    assert dashed.nproc_per_node == "2" and dashed.rdzv_endpoint == "h:1" and dashed.standalone and dashed.module


# ---- the process environment ------------------------------------------------------------

def test_proc_env_carries_torchrun_variables():
    env = ProcEnv(3, 6, "10.0.0.1", 29500, "j", "{}", local_rank=1, local_world_size=3).to_environ("s" * 16)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT")} == {"RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1",
                                                    "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1",
                                                    "MASTER_PORT": "29500"}
    back = ProcEnv.from_environ(env)
    assert (back.local_rank, back.local_world_size, back.origin) == (1, 3, "hetrain")


def test_a_plain_torchrun_process_is_a_workers_only_job():
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc"}
    env = from_torchrun_environ(torchrun)
    assert env.origin == "torchrun" and env.comm.mode == "allreduce"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    topo = build_topology(parse_cluster(__import__("json").loads(env.cluster_json)), env.comm.mode)
    assert topo.world_size == 4 and not topo.servers
    assert topo.proc(3).machine.name == "w3" and topo.proc(3).machine.node == 1
    assert env.run_dir == "runs/torchrun-abc"
    assert from_torchrun_environ({}) is None  # plain python: a one-worker job
    assert ProcEnv.from_environ(torchrun) is None  # no HETRAIN_* variables: not hetrain's launcher
    with pytest.raises(UserError, match="do not describe a job"):
        from_torchrun_environ(dict(torchrun, RANK="4"))


# ---- cores of their own -----------------------------------------------------------------

def _procs(threads, cpus=1, mode="ps"):
    machines = [{"name": f"w{i}", "role": "worker", "device": {}, **({"threads": t} if t else {})}
                for i, t in enumerate(threads)] + [{"name": f"c{j}", "role": "cpu"} for j in range(cpus)]
    return build_topology(parse_cluster({"machines": machines}), mode).procs


def test_workers_get_disjoint_cores_and_the_rest_go_to_the_others():
    procs = _procs([2, 1, None])
    plan = assign_cores(procs, range(8))
    assert plan.pinned == {0: (0, 1), 1: (2,)}
    assert plan.threads_for(0) == 2 and plan.threads_for(1) == 1 and plan.threads_for(2) is None
    assert plan.cores_for(2) == plan.cores_for(3) == (3, 4, 5, 6, 7)  # unpinned worker and the server
    # cores come from the launcher's own affinity, whatever their numbers
    assert assign_cores(procs, [4, 9, 11, 12]).pinned == {0: (4, 9), 1: (11,)}


def test_all_cores_taken_leaves_the_others_unpinned():
    plan = assign_cores(_procs([1, 1]), [0, 1])
    assert plan.pinned == {0: (0,), 1: (1,)} and plan.rest is None and plan.cores_for(2) is None


def test_no_threads_no_pinning():
    plan = assign_cores(_procs([None, None]), range(4))
    assert plan.pinned == {} and plan.cores_for(0) is None


def test_too_many_threads_are_refused_saying_what_to_change():
    with pytest.raises(UserError, match=r"w0 asks for threads: 9, but this host has 8 core\(s\).*at most 8"):
        assign_cores(_procs([9]), range(8))
    with pytest.raises(UserError, match=r"ask for 9 cores together \(w0: 4, w1: 4, w2: 1\).*add up to at most 8"):
        assign_cores(_procs([4, 4, 1]), range(8))


def test_threads_belong_to_worker_machines():
    with pytest.raises(ClusterSpecError, match="cpu machine 'c0': `threads` pins a worker"):
        parse_cluster({"machines": [{"name": "w0", "role": "worker", "device": {}},
                                    {"name": "c0", "role": "cpu", "threads": 2}]})
    with pytest.raises(ClusterSpecError, match="machines.0.threads"):
        parse_cluster({"machines": [{"name": "w0", "role": "worker", "device": {}, "threads": 0}]})


def test_pin_sets_the_affinity_before_the_program_starts():
    core = min(os.sched_getaffinity(0))
    out = subprocess.run(pin([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], [core]),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{core}]"


# ---- entry points -----------------------------------------------------------------------

def test_missing_scripts_and_modules_are_refused():
    check_entry_point([str(SCRIPTS / "steps.py")])
    check_entry_point(["-m", "hetrain.demo.digits", "--epochs", "1"])
    with pytest.raises(UserError, match="training script nosuch.py does not exist"):
        check_entry_point(["nosuch.py"])
    with pytest.raises(UserError, match="no module named 'no.such.module'"):
        check_entry_point(["-m", "no.such.module"])
    with pytest.raises(UserError, match="no module named 'hetrain.nosuch'"):
        check_entry_point(["-m", "hetrain.nosuch"])
    with pytest.raises(UserError, match="package without a __main__"):
        check_entry_point(["-m", "hetrain.cluster"])


def test_a_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "mytrain.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    check_entry_point(["-m", "mytrain"])  # `python -m mytrain` finds it here too


# ---- memory caps without a cluster file -------------------------------------------------

def test_infinite_memory_is_a_huge_cap_not_a_wrapped_one():
    # an uncapped worker's cap is the global batch (no worker can use more), never a wrapped int64
    caps = memory_caps([float("inf")] * 8, BalanceConfig(memory_per_sample=100.0), 64)
    assert caps.tolist() == [64] * 8
    assert balanced_sizes(64, np.ones(8), caps).tolist() == [8] * 8
