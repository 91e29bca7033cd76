"""`hetrain plan` end to end on a saved profile."""
import json

import pytest
import yaml

from hetrain.cli import main
from hetrain.plan.render import load_plan
from hetrain.errors import UserError


@pytest.fixture
def files(tmp_path, tiny_catalogue_dict):
    layers = [{"name": f"l{i}", "kind": k, "time_s": t, "act_bytes": 4096, "stored_act_bytes": 4096,
               "dense_param_bytes": d, "sparse_param_bytes": s}
              for i, (k, t, d, s) in enumerate([("sparse", 2e-4, 0, 4e9), ("dense", 5e-3, 1e6, 0),
                                                ("memory", 1e-3, 1e5, 0), ("dense", 4e-3, 1e6, 0)])]
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"model": "toy", "layers": layers}))
    cat = tmp_path / "cat.yaml"
    cat.write_text(yaml.safe_dump(tiny_catalogue_dict))
    return prof, cat, tmp_path


@pytest.mark.parametrize("planner", ["exact", "rl", "greedy"])
def test_plan_writes_table_json_and_png(files, capsys, planner):
    prof, cat, tmp = files
    out = tmp / f"{planner}.json"
    rc = main(["plan", "--model", str(prof), "--catalogue", str(cat), "--throughput", "200",
               "--planner", planner, "--out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "stage" in text and "$/hour" in text and "samples/s" in text
    plan = load_plan(out)
    assert plan["feasible"] and plan["planner"] == planner
    assert plan["throughput"] >= 200
    assert sum(s["layers"][1] - s["layers"][0] for s in plan["stages"]) == 4
    assert plan["price_per_hour"] == pytest.approx(sum(s["price_per_hour"] for s in plan["stages"]))
    assert out.with_suffix(".png").stat().st_size > 1000


def test_infeasible_target_reports_best_reachable(files, capsys):
    prof, cat, tmp = files
    rc = main(["plan", "--model", str(prof), "--catalogue", str(cat), "--throughput", "1e9",
               "--out", str(tmp / "x.json")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "best reachable throughput is" in err
    best = float(err.split("best reachable throughput is ")[1].split()[0].replace(",", ""))
    assert 0 < best < 1e9
    assert not load_plan(tmp / "x.json")["feasible"]


@pytest.mark.parametrize("args, message", [
    (["--catalogue", "missing.yaml"], "does not exist"),
    (["--planner", "magic"], "unknown planner"),
    (["--throughput", "-5"], "--throughput must be a positive"),
    (["--model", "nosuchmodel"], "neither a built-in model"),
])
def test_bad_cli_inputs_are_clear_errors(files, capsys, args, message):
    prof, cat, tmp = files
    base = {"--model": str(prof), "--catalogue": str(cat), "--throughput": "10", "--planner": "exact"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    argv = ["plan", "--out", str(tmp / "o.json")] + [x for kv in base.items() for x in kv]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err


def test_load_plan_rejects_other_json(tmp_path):
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"hello": 1}))
    with pytest.raises(UserError, match="not a hetrain plan"):
        load_plan(f)


def test_calibrate_uses_a_measured_gpu_for_a_catalogue_type(files, capsys):
    prof, cat, tmp = files
    data = json.loads(prof.read_text())
    data["devices"] = {"cuda: Test GPU": [1e-6, 1e-6, 1e-6, 1e-6]}
    prof.write_text(json.dumps(data))
    out = tmp / "cal.json"
    rc = main(["plan", "--model", str(prof), "--catalogue", str(cat), "--throughput", "200", "--out", str(out),
               "--calibrate", "gpu-a", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "measured on cuda: Test GPU: speed against the profiling host dense" in text
    rc = main(["plan", "--model", str(prof), "--catalogue", str(cat), "--throughput", "200", "--out", str(out),
               "--calibrate", "tpu-z", "--no-progress"])
    assert rc == 2 and "has no type 'tpu-z'" in capsys.readouterr().err
