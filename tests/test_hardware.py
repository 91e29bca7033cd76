"""The one hardware vocabulary (hetrain/cluster/hardware.py): a device kind means the same
in a launcher cluster file, a catalogue and a scheduler's GPU pools; every form
round-trips through it; a plan is checked against the hardware before anything runs."""
import copy
import json
import warnings

import pytest
import yaml

from hetrain.cli import main
from hetrain.cluster import ClusterSpecError, DeviceKind, Inventory, Speed, load_cluster, parse_cluster
from hetrain.cluster.files import OldSpellingWarning, load_inventory
from hetrain.cluster.hardware import HardwareError
from hetrain.plan.catalogue import CatalogueError, PlanFitError, check_plan, load_catalogue, parse_catalogue
from hetrain.sched.cluster import ClusterArgError, parse_cluster_spec

V100 = {"name": "v100", "class": "gpu", "price_per_hour": 3.06, "memory": "16GiB", "bandwidth": "10gbit",
        "speed": {"dense": 69.2, "memory": 23.2, "sparse": 1.08}, "note": "V100 16 GB"}
C5 = {"name": "c5", "class": "cpu", "price_per_hour": 0.68, "memory": "32GiB", "bandwidth": "10gbit", "speed": 4}


def lab_cluster() -> dict:
    """Two V100 machines of 2 GPUs each, three CPU workers, one summation-only machine."""
    machines = [{"name": f"g{i}", "role": "worker", "device": {"kind": "v100"}, "gpus": 2} for i in range(2)]
    machines += [{"name": f"w{i}", "role": "worker", "device": {"kind": "c5"}} for i in range(3)]
    machines += [{"name": "s0", "role": "cpu"}]
    return {"name": "lab", "kinds": copy.deepcopy([V100, C5]), "machines": machines}


@pytest.fixture
def lab(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(yaml.safe_dump(lab_cluster()))
    return path


def test_a_kind_name_means_one_description_in_every_use(lab, tmp_path):
    described = DeviceKind.model_validate(V100)
    cluster = load_cluster(lab)
    inventory = cluster.inventory()
    assert inventory.names == ("v100", "c5") and inventory.counts == (4, 3)   # gpus: 2 counts twice
    assert cluster.kind_of(cluster.machine("g0")) == described
    catalogue = load_catalogue(lab)                      # the planner on the launcher's file
    pools = parse_cluster_spec(str(lab))                 # the scheduler on the same file: its GPU kinds
    assert pools.names == ("v100",) and pools.counts == (4,)
    assert inventory.kind("v100") == catalogue.kind("v100") == pools.kind("v100") == described
    assert catalogue.kind("c5").speed == Speed(dense=4, memory=4, sparse=4)  # one number: every layer kind
    # the same kinds written as a catalogue describe them the same way
    cat_file = tmp_path / "cat.yaml"
    cat_file.write_text(yaml.safe_dump(inventory.to_file()))
    assert load_catalogue(cat_file).kinds == inventory.kinds
    # a kind described nowhere is bare, and the same bare kind on the command line and in a file
    bare = parse_cluster({"machines": [{"name": "g", "role": "worker", "device": {"kind": "v100"}}]})
    assert bare.inventory().kind("v100") == parse_cluster_spec("v100:4").kind("v100") == DeviceKind.bare("v100")
    assert DeviceKind.bare("cpu").device_class == "cpu" and DeviceKind.bare("k80").device_class == "gpu"


def test_catalogue_round_trips(tmp_path):
    for name in ("aws", "gcp"):
        cat = load_catalogue(name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cat.to_file()))
        again = load_catalogue(path)
        assert again == cat and again.source == cat.source and again.names == cat.names


def test_scheduling_pools_round_trip(tmp_path):
    pools = parse_cluster_spec("v100:8,P100:4,k80:2")
    assert pools.spec == "v100:8,p100:4,k80:2"
    again = parse_cluster_spec(pools.spec)              # named after the text it was read from
    assert (again.kinds, again.counts) == (pools.kinds, pools.counts)
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(pools.to_pools(), sort_keys=False))  # pool order = indices
    assert parse_cluster_spec(str(path)) == pools
    assert load_inventory(path) == pools
    gavel = parse_cluster_spec("300:300:300")
    assert parse_cluster_spec(gavel.spec).counts == gavel.counts == (300, 300, 300)


def test_launcher_cluster_file_round_trips(lab, tmp_path):
    cluster = load_cluster(lab)
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump(cluster.to_file()))
    again = load_cluster(path)
    assert again == cluster and again.inventory() == cluster.inventory()
    # its inventory as a catalogue, read back: the same kinds and counts
    assert parse_catalogue(cluster.inventory().to_file(), "<lab inventory>") == cluster.inventory()


def test_plan_on_hardware_that_lacks_a_type_is_refused_before_training(lab, tmp_path, capsys):
    plan = {"format": "hetrain.plan/1", "feasible": True, "target": 100, "batch_size": 256,
            "stages": [{"layers": [0, 3], "type": "c5", "kind": "cpu", "instances": 2},
                       {"layers": [3, 9], "type": "p3.2xlarge", "kind": "gpu", "instances": 3},
                       {"layers": [9, 14], "type": "c5", "kind": "cpu", "instances": 1}]}
    inventory = load_cluster(lab).inventory()
    with pytest.raises(PlanFitError) as exc:
        check_plan(plan, inventory, str(lab), "plan.json")
    msg = str(exc.value)
    assert "stage 1 runs on 'p3.2xlarge', but there is no resource type 'p3.2xlarge'" in msg
    assert "hetrain plan --catalogue" in msg and "device: {kind: NAME}" in msg and "v100 x4, c5 x3" in msg
    # more devices of a kind than there are
    over = dict(plan, stages=[dict(plan["stages"][0], instances=3), dict(plan["stages"][1], type="v100"),
                              plan["stages"][2]])
    with pytest.raises(PlanFitError, match=r"stages 0, 2 need 4 x 'c5', it has 3"):
        check_plan(over, inventory, str(lab))
    # a stage the plan runs as a GPU on what the cluster calls a CPU kind
    wrong_class = dict(plan, stages=[dict(plan["stages"][0], kind="gpu"), dict(plan["stages"][1], type="v100")])
    with pytest.raises(PlanFitError, match="runs 'c5' as a gpu kind, it is a cpu kind there"):
        check_plan(wrong_class, inventory, str(lab))
    fits = dict(plan, stages=[plan["stages"][0], dict(plan["stages"][1], type="v100", instances=4)])
    check_plan(fits, inventory, str(lab))                # fits: no error
    # the same refusal from `hetrain train`, before any process starts: one line, exit code 2
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    run_dir = tmp_path / "run"
    assert main(["train", "--plan", str(plan_path), "--catalogue", str(lab), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "p3.2xlarge" in err and "Traceback" not in err and not (run_dir / "launch").exists()


def test_planner_and_scheduler_run_on_a_launcher_cluster_file(lab, tmp_path, capsys):
    from hetrain.plan.render import load_plan
    from hetrain.sched.patterns import make_pattern
    from hetrain.sched.simulator import simulate

    layers = [{"name": f"l{i}", "kind": k, "time_s": t, "act_bytes": 4096, "stored_act_bytes": 4096,
               "dense_param_bytes": d, "sparse_param_bytes": s}
              for i, (k, t, d, s) in enumerate([("sparse", 2e-4, 0, 4e9), ("dense", 5e-3, 1e6, 0),
                                                ("memory", 1e-3, 1e5, 0), ("dense", 4e-3, 1e6, 0)])]
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"model": "toy", "layers": layers}))
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(prof), "--catalogue", str(lab), "--throughput", "500",
                 "--planner", "exact", "--out", str(out), "--no-progress"]) == 0
    plan = load_plan(out)
    assert plan["feasible"] and {s["type"] for s in plan["stages"]} <= {"v100", "c5"}
    check_plan(plan, load_cluster(lab).inventory(), str(lab))    # the plan fits the machines it was made on
    pools = parse_cluster_spec(str(lab))
    result = simulate(make_pattern("poisson", 4, pools, seed=1), pools, "adaptive")
    assert len(result.jct) == 4 and all(j > 0 for j in result.jct)
    capsys.readouterr()


def test_planning_needs_described_kinds(lab, tmp_path):
    data = lab_cluster()
    data["kinds"] = [V100]                               # c5 described nowhere
    path = tmp_path / "half.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogueError, match="kind 'c5' has no price_per_hour, memory, bandwidth, speed.*"
                                             "describe it under `kinds:`"):
        load_catalogue(path)
    with pytest.raises(CatalogueError, match="GPU pools"):
        parse_catalogue({"gpus": {"v100": 4}})
    cat = {"types": [{k: v for k, v in V100.items() if k != "memory"} | {"count": 2}]}
    with pytest.raises(CatalogueError, match="types.0.memory: required for planning"):
        parse_catalogue(cat, "c.yaml")


def test_old_catalogue_spelling_loads_with_a_warning(tmp_path):
    old = {"name": "old", "types": [{"name": "g", "kind": "gpu", "price_per_hour": 1, "count": 2, "memory": "8GiB",
                                     "bandwidth": "1gbit", "speed": 3}]}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    with pytest.warns(OldSpellingWarning, match="rename the key to `class`"):
        cat = load_catalogue(path)
    assert cat.kind("g").device_class == "gpu" and cat.counts == (2,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # the shipped catalogues use the new key
        load_catalogue("aws")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["kinds"].append(dict(V100)), r"kinds \['v100'\] are described twice"),
    (lambda d: d["machines"][0]["device"].update(kind="c5", cuda=True), "machines.0.device: kind 'c5' is a CPU kind"),
    (lambda d: d["kinds"][1].update({"class": "fpga"}), "kinds.1.class"),
    (lambda d: d["kinds"][0].update(speed={"dense": 2}), "kinds.0.speed.memory: required"),
    (lambda d: d["kinds"][0].update(memory="lots"), "kinds.0.memory: cannot read memory size"),
])
def test_bad_kinds_in_a_cluster_file_are_named(mutate, message):
    data = lab_cluster()
    mutate(data)
    with pytest.raises(ClusterSpecError, match=message):
        parse_cluster(data, "lab.yaml")


def test_bad_pools_say_what_to_write(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("machines: []\n")
    with pytest.raises(ClusterSpecError, match="no worker machine"):
        parse_cluster_spec(str(path))
    path.write_text("colour: red\n")
    with pytest.raises(ClusterArgError, match="`types:` .*`gpus:` .*`machines:`"):
        parse_cluster_spec(str(path))
    path.write_text(yaml.safe_dump({"machines": [{"name": "w", "role": "worker", "device": {"kind": "cpu"}}]}))
    with pytest.raises(HardwareError, match="has no GPU kind"):
        parse_cluster_spec(str(path))
    with pytest.raises(ClusterArgError, match="v100!"):
        parse_cluster_spec("v100!:2")
    with pytest.raises(ValueError, match="one count per kind"):
        Inventory(kinds=(DeviceKind.bare("a"),), counts=(1, 2))


def test_ray_bundles_follow_the_kinds_class():
    from hetrain.runtime.ray_backend import RayOptions, machine_bundles

    cluster = parse_cluster(lab_cluster())
    have = {"CPU": 16, "GPU": 4, "accelerator_type:V100": 2}
    bundles, index = machine_bundles(cluster, "allreduce", RayOptions(cpus_per_process=1), have)
    # g0 runs 2 workers (gpus: 2): one GPU each
    assert bundles[index["g0"]] == {"CPU": 2.0, "GPU": 2.0, "accelerator_type:V100": 0.001}
    assert bundles[index["w0"]] == {"CPU": 1.0}           # c5 is described as a CPU kind: no GPU
