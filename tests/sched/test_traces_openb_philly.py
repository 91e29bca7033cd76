"""The OpenB and Philly-runtime converters on miniature files in the published formats."""
import numpy as np
import pytest

from hetrain.sched.cluster import parse_cluster_spec
from hetrain.sched.simulator import simulate
from hetrain.sched.traces_openb import (OpenBError, openb_cluster, openb_jobs, read_openb_nodes,
                                        read_openb_pods)
from hetrain.sched.traces_philly import MIN_RUNTIME_S, PhillyError, philly_workload, read_philly_runtimes

NODES = """sn,cpu_milli,memory_mib,gpu,model
openb-node-0000,64000,262144,2,P100
openb-node-0001,96000,393216,8,G2
openb-node-0002,96000,393216,8,G2
openb-node-0003,104000,524288,2,T4
openb-node-0004,32000,131072,4,V100M16
openb-node-0005,32000,131072,0,
"""
POD_HEAD = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
PODS = POD_HEAD + """openb-pod-0000,12000,16384,1,1000,,LS,Running,0,5000,0
openb-pod-0001,6000,12288,1,460,,BE,Succeeded,100,700,150
openb-pod-0002,4000,8192,0,0,,BE,Succeeded,120,900,120
openb-pod-0003,88000,327680,8,1000,,Burstable,Failed,200,1400,260
openb-pod-0004,11908,47104,1,1000,,BE,Pending,300,400,
openb-pod-0005,8000,30000,2,1000,V100M16|V100M32,LS,Succeeded,400,2400,400
openb-pod-0006,8000,30000,1,1000,A10,LS,Succeeded,500,900,500
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "pods.csv").write_text(PODS)
    return tmp_path


def test_node_list_gives_pools_whole_and_scaled(files):
    models = read_openb_nodes(files / "nodes.csv")
    assert models == {"P100": 2, "G2": 16, "T4": 2, "V100M16": 4}
    whole = openb_cluster(models)
    assert dict(zip(whole.names, whole.counts)) == {"g2": 16, "v100m16": 4, "p100": 2, "t4": 2}
    half = openb_cluster(models, 12)
    assert half.total == 12 and dict(zip(half.names, half.counts)) == {"g2": 8, "v100m16": 2, "p100": 1, "t4": 1}


def test_pod_rules(files):
    pods = {p.name: p for p in read_openb_pods(files / "pods.csv")}
    # CPU-only (0002) and never-placed (0004, no scheduled_time) pods are left out
    assert sorted(pods) == ["openb-pod-0000", "openb-pod-0001", "openb-pod-0003", "openb-pod-0005",
                            "openb-pod-0006"]
    assert pods["openb-pod-0001"].fractional and pods["openb-pod-0001"].gpus == 1   # 460 milli -> one GPU
    assert pods["openb-pod-0001"].run_s == 550                                       # deletion - scheduled
    assert pods["openb-pod-0003"].run_s == 1140 and pods["openb-pod-0003"].phase == "Failed"
    assert pods["openb-pod-0005"].models == ("V100M16", "V100M32")


def test_jobs_honour_type_constraints_and_arrivals(files):
    cluster = openb_cluster(read_openb_nodes(files / "nodes.csv"))
    pods = read_openb_pods(files / "pods.csv")
    jobs = openb_jobs(pods, cluster)
    # pod 0006 may only run on an A10, which this cluster has none of: left out
    assert len(jobs) == 4
    assert [j.arrival for j in jobs] == [0.0, 100.0, 200.0, 400.0]
    assert [j.requested for j in jobs] == [1, 1, 8, 2]
    names = list(cluster.names)
    constrained = jobs[3]
    for t, name in enumerate(names):
        assert (constrained.base_rates[t].max() > 0) == (name == "v100m16")
        if constrained.goodput_rates is not None:
            assert (constrained.goodput_rates[t].max() > 0) == (name == "v100m16")
    # work = lifetime on its GPU count of its reference type: pod 0001 ran 550 s on one g2
    g2 = names.index("g2")
    assert jobs[1].work == pytest.approx(550 * jobs[1].base_rates[g2, 1])
    for pol in ("goodput", "sia", "fifo"):
        res = simulate(openb_jobs(pods, cluster), cluster, pol)
        assert np.all(np.isfinite(res.finish))
    assert openb_jobs(pods, cluster, time_scale=100.0)[3].arrival == pytest.approx(4.0)


def test_openb_errors_say_what_is_wrong(tmp_path):
    (tmp_path / "bad.csv").write_text("sn,gpu\nx,2\n")
    with pytest.raises(OpenBError, match="missing model"):
        read_openb_nodes(tmp_path / "bad.csv")
    (tmp_path / "pods.csv").write_text(POD_HEAD + "p,1,1,1,1000,H100,LS,Running,0,10,zero\n")
    with pytest.raises(OpenBError, match=r"pods.csv:2: column scheduled_time is 'zero'"):
        read_openb_pods(tmp_path / "pods.csv")
    (tmp_path / "pods.csv").write_text(POD_HEAD + "p,1,1,1,1000,H100,LS,Running,0,10,0\n")
    with pytest.raises(OpenBError, match="unknown model"):
        read_openb_pods(tmp_path / "pods.csv")


def test_philly_runtimes_make_poisson_workloads(tmp_path):
    (tmp_path / "philly_runtime.csv").write_text("runtime\n0.0\n1.0\n59\n600\n1200\n86400\n")
    runs = read_philly_runtimes(tmp_path / "philly_runtime.csv")
    assert sorted(runs.tolist()) == [600.0, 1200.0, 86400.0]      # under MIN_RUNTIME_S dropped
    assert MIN_RUNTIME_S == 60.0
    cluster = parse_cluster_spec("v100:4,p100:4,k80:4")
    jobs = philly_workload(runs, 30, cluster, seed=1)
    assert len(jobs) == 30 and jobs[0].arrival == 0 and np.all(np.diff([j.arrival for j in jobs]) >= 0)
    for j in jobs:  # each job's work is one of the runtimes on its size of its fastest type
        best = j.base_rates[:, j.requested].max()
        assert min(abs(j.work / best - r) for r in runs) < 1e-6 * j.work / best
    assert philly_workload(runs, 30, cluster, seed=1)[7].work == jobs[7].work  # deterministic
    (tmp_path / "bad.csv").write_text("seconds\n5\n")
    with pytest.raises(PhillyError, match="'runtime' column"):
        read_philly_runtimes(tmp_path / "bad.csv")
