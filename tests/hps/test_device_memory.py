"""Memory caps come from the device: cgroup v2 / v1, RLIMIT_AS and available RAM on a
CPU (the binding one wins), the driver's free memory on a GPU; the cluster file overrides."""
import resource

import pytest
import torch

from hetrain.cluster.spec import parse_cluster
from hetrain.runtime import memory as devmod
from hetrain.runtime.memory import cgroup_remaining, cpu_memory_limit, memory_limit


def _proc(tmp_path, cgroup: str, meminfo_kb: int, vmsize_kb: int = 1000):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "status").write_text(f"Name:\tpython\nVmSize:\t{vmsize_kb} kB\n")
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
    return proc


def test_cgroup_v2_tightest_level_binds(tmp_path):
    root = tmp_path / "cg"
    job = root / "jobs" / "j1"
    job.mkdir(parents=True)
    (root / "jobs" / "memory.max").write_text(str(8 * 2**30) + "\n")
    (root / "jobs" / "memory.current").write_text(str(7 * 2**30) + "\n")  # parent: 1 GiB left
    (job / "memory.max").write_text("max\n")
    (job / "memory.current").write_text(str(2**30) + "\n")
    proc = _proc(tmp_path, "0::/jobs/j1\n", meminfo_kb=16 * 2**20)
    left, detail = cgroup_remaining(root, proc)
    assert left == 2**30 and "jobs/memory.max" in detail
    lim = cpu_memory_limit(root, proc)
    assert lim.source == "cgroup" and lim.bytes == 2**30


def test_cgroup_v1_limit(tmp_path):
    root = tmp_path / "cg"
    mem = root / "memory" / "docker" / "abc"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(str(3 * 2**30))
    (mem / "memory.usage_in_bytes").write_text(str(2**30))
    proc = _proc(tmp_path, "4:memory:/docker/abc\n0::/\n", meminfo_kb=16 * 2**20)
    assert cgroup_remaining(root, proc)[0] == 2 * 2**30
    assert cpu_memory_limit(root, proc).source == "cgroup"


def test_unlimited_cgroup_falls_back_to_available_ram(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "memory.max").write_text("max\n")
    (root / "memory.current").write_text("123\n")
    proc = _proc(tmp_path, "0::/\n", meminfo_kb=2 * 2**20)
    assert cgroup_remaining(root, proc) is None
    lim = cpu_memory_limit(root, proc)
    if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        assert lim.source == "ram" and lim.bytes == 2 * 2**30


def test_rlimit_as_binds_when_lowest(tmp_path, monkeypatch):
    monkeypatch.setattr(devmod.resource, "getrlimit", lambda which: (5 * 2**30, resource.RLIM_INFINITY))
    proc = _proc(tmp_path, "0::/\n", meminfo_kb=64 * 2**20, vmsize_kb=2**20)  # 1 GiB mapped
    lim = cpu_memory_limit(tmp_path / "none", proc)
    assert lim.source == "rlimit" and lim.bytes == 4 * 2**30


def test_this_host_reports_a_positive_cpu_limit():
    lim = memory_limit(torch.device("cpu"))
    assert 0 < lim.bytes and lim.source in ("cgroup", "rlimit", "ram")


def test_cluster_memory_is_an_optional_override():
    spec = parse_cluster({"machines": [{"name": "w0", "role": "worker", "device": {"speed": 1.0}},
                                       {"name": "w1", "role": "worker", "device": {"memory": "2GiB"}}]})
    assert spec.machines[0].device.memory is None  # measured
    assert spec.machines[1].device.memory == 2 * 2**30


@pytest.mark.gpu
def test_gpu_memory_from_the_driver():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", 0)
    lim = memory_limit(dev)
    free, total = torch.cuda.mem_get_info(dev)
    assert dev.type == "cuda" and lim.source == "cuda" and 0 < lim.bytes <= total


def test_workers_sharing_a_gpu_split_its_free_memory(monkeypatch):
    """Each worker bound to one GPU of a host gets an equal part of its free memory, not
    all of it (three machines of one node put their worker on cuda:0, as does local rank 0
    of a two-GPU machine; its local rank 1 has cuda:1 alone)."""
    from types import SimpleNamespace

    from hetrain.runtime.memory import MemoryLimit
    from hetrain.runtime.topology import build_topology
    from hetrain.train import balance_devices
    from hetrain.train.balance import Balancer, BalanceConfig

    cluster = parse_cluster({"machines": [{"name": f"g{i}", "role": "worker", "device": {"cuda": True}}
                                          for i in range(3)]
                             + [{"name": "m", "role": "worker", "device": {"cuda": True}, "gpus": 2}]})
    topo = build_topology(cluster, "allreduce")
    monkeypatch.setattr(balance_devices, "memory_limit", lambda device: MemoryLimit(12 * 2**30, "cuda", "12 GiB free"))
    got = {}
    for p in topo.workers:
        me = SimpleNamespace(ctx=SimpleNamespace(topology=topo, rank=p.rank), cfg=BalanceConfig(memory_per_sample=1.0),
                             device=torch.device("cuda", p.local_rank))
        got[(p.machine.name, p.local_rank)] = Balancer._my_memory(me, None)
    assert got[("g0", 0)].bytes == got[("m", 0)].bytes == 3 * 2**30
    assert "split over 4 workers on this host's cuda:0" in got[("g1", 0)].detail
    assert got[("m", 1)].bytes == 12 * 2**30


def test_gpu_batch_shares_count_the_engine_buffers():
    """On a GPU, hetrain's own push_pull buffers (work buffer; with a codec also the residual
    and payload) are reserved with the model's state before samples get memory."""
    from hetrain.runtime.memory import engine_device_bytes

    assert engine_device_bytes(1000, codec=False) == 4000
    assert engine_device_bytes(1000, codec=True) == 12000
