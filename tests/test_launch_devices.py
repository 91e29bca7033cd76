"""Which GPU each process of a launch is bound to, on the CPU: `torch.cuda`'s device
count is monkeypatched, and the launcher's pure parts (flags -> cluster, pre-flight,
the environment a process gets, Ray's bundles and device view) are checked.

- `--nproc-per-node gpu|auto` makes one worker per CUDA device, each bound to its own;
- a multi-node cluster file run on one host: its GPUs are told apart by host and device,
  so workers of two cluster nodes on cuda:0 are seen to share it (gloo), and
  `--collective nccl` is refused with what to do;
- LOCAL_RANK names the GPU hetrain binds (`torch.cuda.set_device(LOCAL_RANK)` agrees);
- Ray: a GPU machine's bundle holds one GPU per worker, its servers ask for none, and the
  processes see the GPUs Ray granted so that each binds its own and NCCL is chosen."""
import pytest
import torch

from hetrain.cluster.spec import parse_cluster
from hetrain.errors import UserError
from hetrain.runtime.devices import one_host, plan_backends, preflight, sharing_note, worker_device
from hetrain.runtime.env import CommConfig
from hetrain.runtime.launch import LaunchConfig, process_env
from hetrain.runtime.topology import build_topology


@pytest.fixture
def two_gpus(monkeypatch):
    """This host as one with 2 CUDA devices and NCCL, as far as the launcher asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)


def _env(cfg: LaunchConfig, cluster, rank: int, local_rank: int) -> dict[str, str]:
    topo = build_topology(cluster, cfg.comm.mode)
    return process_env(cfg, topo.proc(rank), topo, cluster, "127.0.0.1", 1, "job", "s", "/tmp/run",
                       local_rank=local_rank, local_world_size=len(topo.procs), script_port=2)


def test_nproc_per_node_gpu_binds_each_worker_to_its_own_gpu(two_gpus):
    from hetrain.cli import build_parser
    from hetrain.runtime.cli import launch_config

    for spelling in ("gpu", "auto"):
        args = build_parser().parse_args(["launch", "--nproc-per-node", spelling, "train.py"])
        cfg = launch_config(args, ["train.py"])
        topo = build_topology(cfg.cluster, cfg.comm.mode)
        assert [str(worker_device(p)) for p in topo.workers] == ["cuda:0", "cuda:1"], spelling
        assert plan_backends(topo, cfg.comm).worker == "nccl"  # two GPUs of their own
        assert preflight(cfg.cluster, topo, cfg.comm, None).worker == "nccl"
        assert [_env(cfg, cfg.cluster, r, r)["LOCAL_RANK"] for r in (0, 1)] == ["0", "1"]


def test_nproc_per_node_gpu_without_cuda_is_refused_and_auto_falls_back_to_cpu(monkeypatch):
    from hetrain.runtime.torchrun import parse_nproc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no CUDA device"):
        parse_nproc("gpu")
    assert not parse_nproc("auto").cuda


def _two_node_file(index: int | None = None) -> dict:
    second = {"cuda": True} if index is None else {"cuda": True, "index": index}
    return {"name": "two-nodes", "machines": [
        {"name": "a", "role": "worker", "device": {"kind": "gpu", "cuda": True}, "node": 0},
        {"name": "b", "role": "worker", "device": {"kind": "gpu", **second}, "node": 1}]}


def test_a_multinode_cluster_file_on_one_host_shares_cuda0_instead_of_two_nccl_ranks(two_gpus):
    cluster = parse_cluster(_two_node_file())
    topo = build_topology(cluster, "allreduce")
    # both machines bind cuda:0; on one host (an embedded launch) that is one GPU, not two
    assert [str(worker_device(p)) for p in topo.workers] == ["cuda:0", "cuda:0"]
    with pytest.raises(UserError, match=r"cuda:0 of host 0.*device.index"):
        preflight(cluster, topo, CommConfig(mode="allreduce", collective="nccl"), None)
    assert preflight(cluster, topo, CommConfig(mode="allreduce"), None).worker == "gloo"
    seen = build_topology(one_host(cluster), "allreduce")  # what the processes are told
    assert plan_backends(seen, CommConfig(mode="allreduce")).worker == "gloo"
    assert "a, b on cuda:0" in sharing_note(seen, CommConfig(mode="allreduce"))
    # run node by node (one launcher per host), the same file's GPUs are two: NCCL
    assert preflight(cluster, topo, CommConfig(mode="allreduce"), 1).worker == "nccl"
    # a GPU of its own on this host: NCCL, and pre-flight counts the devices it names
    own = parse_cluster(_two_node_file(index=1))
    assert preflight(own, build_topology(own, "allreduce"), CommConfig(mode="allreduce"), None).worker == "nccl"
    beyond = parse_cluster(_two_node_file(index=2))
    with pytest.raises(UserError, match=r"cuda:2\.\.2.*has 2 CUDA device"):
        preflight(beyond, build_topology(beyond, "allreduce"), CommConfig(mode="allreduce"), None)


def test_an_embedded_launch_tells_its_processes_one_host():
    cfg = LaunchConfig(parse_cluster(_two_node_file()), ["train.py"], CommConfig(mode="allreduce"))
    view = one_host(cfg.cluster)
    env = _env(cfg, view, 1, 1)
    told = parse_cluster.__globals__["ClusterSpec"].model_validate_json(env["HETRAIN_CLUSTER"])
    assert {m.node for m in told.machines} == {0}
    assert env["GROUP_WORLD_SIZE"] == "2" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_local_rank_names_the_gpu_hetrain_binds():
    """Two `gpus: 2` machines on one host: their workers bind cuda:0, cuda:1 each, and a
    script's `torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))` must pick the same."""
    cluster = parse_cluster({"machines": [
        {"name": f"m{i}", "role": "worker", "device": {"kind": "gpu", "cuda": True}, "gpus": 2} for i in range(2)]})
    cfg = LaunchConfig(cluster, ["train.py"], CommConfig(mode="allreduce"))
    topo = build_topology(cluster, "allreduce")
    for launcher_index, p in enumerate(topo.workers):  # the launcher's order: 0, 1, 2, 3
        env = _env(cfg, cluster, p.rank, launcher_index)
        assert f"cuda:{env['LOCAL_RANK']}" == str(worker_device(p))
    cpu = LaunchConfig(parse_cluster({"machines": [{"name": f"c{i}", "role": "worker", "device": {"kind": "cpu"}}
                                                   for i in range(2)]}), ["train.py"], CommConfig(mode="allreduce"))
    assert _env(cpu, cpu.cluster, 1, 1)["LOCAL_RANK"] == "1"  # CPU workers: their place on the host


def test_ray_bundles_hold_a_gpu_per_worker_and_servers_ask_for_none():
    from hetrain.runtime.ray_backend import RayOptions, actor_resources, machine_bundles

    cluster = parse_cluster({"machines": [
        {"name": "g", "role": "worker", "device": {"kind": "gpu", "cuda": True}, "gpus": 2},
        {"name": "c", "role": "cpu"}]})
    opts = RayOptions(cpus_per_process=1.0)
    bundles, index = machine_bundles(cluster, "byteps", opts, {"CPU": 8, "GPU": 2})
    assert bundles[index["g"]] == {"CPU": 3.0, "GPU": 2.0}  # 2 workers + 1 co-located server
    topo = build_topology(cluster, "byteps")
    asks = [actor_resources(p, cluster, opts).get("num_gpus", 0) for p in topo.procs if p.machine.name == "g"]
    assert sorted(asks) == [0, 1, 1]  # what the bundle holds: one GPU per worker, none for the server


def test_ray_processes_see_the_gpus_ray_granted_and_use_nccl():
    from hetrain.runtime.ray_backend import device_view

    cluster = parse_cluster({"machines": [
        {"name": "g0", "role": "worker", "device": {"kind": "gpu", "cuda": True}, "gpus": 2},
        {"name": "g1", "role": "worker", "device": {"kind": "gpu", "cuda": True}},
        {"name": "g2", "role": "worker", "device": {"kind": "gpu", "cuda": True}},
        {"name": "c", "role": "cpu"}]})  # as the Ray launcher places it: every machine on node 0
    view, visible = device_view(cluster, {"g0": ["3", "5"], "g1": ["1"], "g2": ["0"]},
                                {"g0": 0, "g1": 0, "g2": 1, "c": 1})
    assert visible == {"g0": "3,5,1", "g1": "3,5,1", "g2": "0", "c": "0"}
    topo = build_topology(view, "allreduce")
    bound = {(p.machine.name, p.local_rank): str(worker_device(p)) for p in topo.workers}
    # each worker's cuda:i is, in its node's CUDA_VISIBLE_DEVICES, the GPU Ray gave its actor
    assert bound == {("g0", 0): "cuda:0", ("g0", 1): "cuda:1", ("g1", 0): "cuda:2", ("g2", 0): "cuda:0"}
    assert plan_backends(topo, CommConfig(mode="allreduce")).worker == "nccl"
    assert plan_backends(build_topology(cluster, "allreduce"), CommConfig(mode="allreduce")).worker == "gloo"


def test_hetrain_local_rank_is_the_bound_gpu(monkeypatch):
    """A Horovod script's `torch.cuda.set_device(hvd.local_rank())` must keep the GPU
    hetrain bound: on a CUDA worker `local_rank()` is that device's index."""
    import hetrain
    from hetrain.api import basics
    from hetrain.runtime import context

    cluster = parse_cluster({"machines": [
        {"name": f"m{i}", "role": "worker", "device": {"kind": "gpu", "cuda": True}, "gpus": 2} for i in range(2)]})
    topo = build_topology(cluster, "allreduce")
    for p in topo.workers:
        ctx = context.Context(None, cluster, topo, None, None, device=worker_device(p))
        monkeypatch.setattr(basics, "joined", lambda ctx=ctx, p=p: _AtRank(ctx, p.rank))
        assert hetrain.local_rank() == worker_device(p).index


class _AtRank:
    """A context of a given rank (what the API's calls join in a worker)."""

    def __init__(self, ctx, rank: int) -> None:
        self._ctx, self.rank = ctx, rank

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def test_two_node_launchers_on_one_host_with_gpus_are_refused_under_nccl(two_gpus):
    """`hetrain launch --nnodes 2 --node_rank 0|1 --nproc-per-node gpu` twice on one host:
    each node's worker i binds cuda:i of the same host; the leader, told each node's
    host, refuses NCCL between them, saying what to do, and lets gloo share the GPUs."""
    from hetrain.runtime.devices import host_clash
    from hetrain.runtime.torchrun import workers_cluster

    cluster = workers_cluster(2, 2, cuda=True)
    topo = build_topology(cluster, "allreduce")
    comm = CommConfig(mode="allreduce")
    assert plan_backends(topo, comm).worker == "nccl"  # as each node sees it: GPUs of their own
    why = host_clash(topo, comm, {0: "hostA/boot", 1: "hostA/boot"})
    assert "nodes 0, 1 run on one host" in why and "cuda:0" in why and "--collective gloo" in why
    assert host_clash(topo, comm, {0: "hostA/boot", 1: "hostB/boot"}) is None  # two hosts: fine
    assert host_clash(topo, CommConfig(mode="allreduce", collective="gloo"), {0: "h", 1: "h"}) is None
