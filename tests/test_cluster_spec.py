import pytest
import yaml

from hetrain.cli import main
from hetrain.cluster import ClusterSpecError, default_cluster, load_cluster, parse_cluster
from hetrain.cluster.units import parse_rate, parse_size


def _cluster(**over):
    base = {"machines": [{"name": "w0", "role": "worker", "device": {"speed": 1.0}, "bandwidth": "1gbit"},
                         {"name": "c0", "role": "cpu", "bandwidth": "1gbit"}]}
    base.update(over)
    return base


def test_default_cluster_is_mixed():
    c = default_cluster()
    assert [m.device.speed for m in c.workers] == [1.0, 1.0, 0.5, 0.25]
    assert len(c.cpu_machines) == 2


def test_units():
    assert parse_rate("400mbit") == pytest.approx(50e6)
    assert parse_rate("1gbit") == pytest.approx(125e6)
    assert parse_rate("50MB/s") == pytest.approx(50e6)
    assert parse_size("4GiB") == 4 * 2**30
    with pytest.raises(ValueError, match="unknown unit"):
        parse_rate("5 furlongs")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["machines"][0].update(bandwdith="1gbit"), "unknown key 'bandwdith'"),
    (lambda d: d["machines"][0].update(bandwidth=-5), "bandwidth must be positive"),
    (lambda d: d["machines"][0].pop("device"), "worker machine 'w0' has no device"),
    (lambda d: d["machines"][1].update(name="w0"), "duplicate machine names"),
    (lambda d: d["machines"][1].update(device={"speed": 1}), "runs only a summation server"),
    (lambda d: d["machines"][0]["device"].update(speed=1.5), "speed"),
    (lambda d: d["machines"][0].update(address="not-an-ip"), "not an IP address"),
    (lambda d: d.update(machines=[d["machines"][1]]), "no worker machine"),
    (lambda d: d.update(network={"emulate": "netns", "mtu": 100}), "network.mtu"),
])
def test_bad_cluster_files_are_named(mutate, message):
    data = _cluster()
    mutate(data)
    with pytest.raises(ClusterSpecError, match=message):
        parse_cluster(data, "bad.yaml")


def test_error_names_the_field_path():
    data = _cluster()
    data["machines"][0]["bandwidth"] = "fast"
    with pytest.raises(ClusterSpecError) as exc:
        parse_cluster(data, "bad.yaml")
    assert "machines.0.bandwidth" in str(exc.value) and "bad.yaml" in str(exc.value)


def test_cli_reports_bad_file_without_traceback(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_cluster(network={"emulate": "teleport"})))
    assert main(["launch", "--cluster", str(path), "x.py"]) == 2
    err = capsys.readouterr().err
    assert "network.emulate" in err and "Traceback" not in err
    path.write_text("machines: [unclosed")
    assert main(["launch", "--cluster", str(path), "x.py"]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["launch", "--cluster", str(tmp_path / "missing.yaml"), "x.py"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_roundtrip_through_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_cluster()))
    c = load_cluster(path)
    assert c.workers[0].bandwidth == pytest.approx(125e6)


def test_gpus_per_machine():
    from hetrain.runtime.devices import plan_backends, worker_device
    from hetrain.runtime.env import CommConfig
    from hetrain.runtime.topology import build_topology

    data = _cluster()
    data["machines"][0]["gpus"] = 3
    c = parse_cluster(data)
    topo = build_topology(c, "byteps")
    assert [(p.rank, p.local_rank) for p in topo.workers] == [(0, 0), (1, 1), (2, 2)]
    assert topo.worker_machines == [[0, 1, 2]] and topo.local_peers(1) == [0, 1, 2]
    servers = [p.machine.name for p in topo.servers]
    assert len(servers) == len(set(servers))  # at most one server per machine, not one per GPU
    assert all(worker_device(p).type == "cpu" for p in topo.workers)  # emulated GPUs
    assert plan_backends(topo, CommConfig()).local == {"w0": "gloo"}
    assert "local rank 2" in topo.describe(2)
    data["machines"][0]["device"]["cuda"] = True
    topo = build_topology(parse_cluster(data), "byteps")
    assert [str(worker_device(p)) for p in topo.workers] == ["cuda:0", "cuda:1", "cuda:2"]
    assert plan_backends(topo, CommConfig()).local == {"w0": "nccl"}
    data["machines"][1]["gpus"] = 2
    with pytest.raises(ClusterSpecError, match="remove its `gpus`"):
        parse_cluster(data)
    data["machines"][1].pop("gpus")
    data["machines"][0]["gpus"] = 0
    with pytest.raises(ClusterSpecError, match="machines.0.gpus"):
        parse_cluster(data)


def test_workers_sharing_a_gpu_stay_on_gloo():
    from hetrain.errors import UserError
    from hetrain.runtime.devices import plan_backends
    from hetrain.runtime.env import CommConfig
    from hetrain.runtime.topology import build_topology

    two = {"machines": [{"name": f"g{i}", "role": "worker", "device": {"cuda": True}} for i in range(2)]}
    topo = build_topology(parse_cluster(two), "allreduce")
    assert plan_backends(topo, CommConfig(mode="allreduce")).worker == "gloo"  # both on cuda:0 of node 0
    with pytest.raises(UserError, match="refuses two ranks on one GPU"):
        plan_backends(topo, CommConfig(mode="allreduce", collective="nccl"))
    two["machines"][1]["node"] = 1
    topo = build_topology(parse_cluster(two), "allreduce")
    assert plan_backends(topo, CommConfig(mode="allreduce")).worker == "nccl"
