"""`hetrain plan`, `schedule`, `train --plan` and `report` with bad files and flags: one
line naming what is wrong, exit code 2, no traceback (in-process, through hetrain.cli.main)."""
import json

import pytest

from hetrain.cli import main, one_line

PLAN = {"format": "hetrain.plan/1", "feasible": True, "target": 100, "batch_size": 256,
        "stages": [{"layers": [0, 14], "type": "cpu", "kind": "cpu", "instances": 1}]}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "broken.json").write_text("{bad")
    (tmp_path / "broken.yaml").write_text("a: [")
    (tmp_path / "profile.json").write_text('{"model": "x"}')
    (tmp_path / "catalogue.yaml").write_text("name: x\ntypes: 3\n")
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "no_stages.json").write_text(json.dumps({k: v for k, v in PLAN.items() if k != "stages"}))
    bad = dict(PLAN, stages=[dict(PLAN["stages"][0], instances="two")])
    (tmp_path / "bad_instances.json").write_text(json.dumps(bad))
    for name, text in (("run_cut", '{"step": 0, "ranks": {}}\n{"step": 1, "ran'), ("run_other", '{"step": 0}\n')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "steps.jsonl").write_text(text)
    return tmp_path


PLAN_ARGS = ["--catalogue", "aws", "--throughput", "100", "--planner", "greedy"]
CASES = [
    # hetrain plan
    (["plan", "--model", "nope.json", *PLAN_ARGS], "profile file nope.json does not exist"),
    (["plan", "--model", "nosuchmodel", *PLAN_ARGS], "--model 'nosuchmodel'"),
    (["plan", "--model", "broken.json", *PLAN_ARGS], "broken.json is not valid JSON"),
    (["plan", "--model", "profile.json", *PLAN_ARGS], "layers: required"),
    (["plan", "--model", "ctr", "--catalogue", "broken.yaml", "--throughput", "100"], "not valid YAML at line 1"),
    (["plan", "--model", "ctr", "--catalogue", "catalogue.yaml", "--throughput", "100"], "types:"),
    (["plan", "--model", "ctr", "--catalogue", "aws", "--throughput", "abc"], "argument --throughput"),
    (["plan", "--model", "ctr", "--catalogue", "aws", "--throughput", "-3"], "--throughput must be"),
    (["plan", "--model", "ctr", *PLAN_ARGS, "--batch-size", "0"], "--batch-size"),
    (["plan", "--model", "ctr", *PLAN_ARGS[:-1], "bogus"], "unknown planner 'bogus'"),
    (["plan", "--model", "ctr", *PLAN_ARGS, "--out", "missing/dir/plan.json"], "--out missing/dir/plan.json"),
    (["plan", "--model", "ctr", *PLAN_ARGS, "--samples", "-1"], "--samples"),
    (["plan", "--catalogue", "aws", "--throughput", "100"], "required: --model"),
    (["plan", "--model", "ctr", *PLAN_ARGS, "--bogus-flag"], "--bogus-flag"),
    # hetrain train --plan
    (["train", "--plan", "nope.json"], "plan file nope.json does not exist"),
    (["train", "--plan", "broken.json"], "not valid JSON"),
    (["train", "--plan", "profile.json"], "not a hetrain plan"),
    (["train", "--plan", "no_stages.json"], "stages: required"),
    (["train", "--plan", "bad_instances.json"], "stages.0.instances"),
    (["train", "--plan", "plan.json", "--steps", "0"], "steps >= 1"),
    (["train", "--plan", "plan.json", "--ps-shards", "0"], "--ps-shards"),
    (["train", "--plan", "plan.json", "--ps-memory", "lots"], "--ps-memory"),
    (["train", "--plan", "plan.json", "--lr", "-1"], "--lr"),
    (["train", "--plan", "plan.json", "--catalogue", "broken.yaml"], "not valid YAML"),
    (["train", "--plan", "plan.json", "--optimizer", "adam"], "argument --optimizer"),
    # hetrain report
    (["report", "no_such_run"], "steps.jsonl does not exist"),
    (["report", "run_cut"], "line 2 is not valid JSON"),
    (["report", "run_other"], "line 1 has no 'ranks'"),
    # hetrain schedule
    (["schedule", "simulate", "--pattern", "bogus"], "unknown pattern 'bogus'"),
    (["schedule", "simulate", "--trace", "nope.trace"], "nope.trace does not exist"),
    (["schedule", "simulate", "--pattern", "poisson", "--cluster", "v100:x"], "bad cluster pool 'v100:x'"),
    (["schedule", "simulate", "--pattern", "poisson", "--policy", "bogus"], "unknown policy 'bogus'"),
    (["schedule", "simulate", "--pattern", "poisson", "--jobs", "0"], "--jobs"),
    (["schedule", "simulate", "--pattern", "poisson", "--throughputs", "nope.json"], "nope.json"),
    (["schedule", "simulate"], "--trace --pattern is required"),
    (["schedule", "run", "--cluster", "v100:x"], "bad cluster pool"),
]


@pytest.mark.parametrize("argv, expected", CASES, ids=[" ".join(a[:3]) + f" #{i}" for i, (a, _) in enumerate(CASES)])
def test_bad_input_is_one_line_and_exit_2(argv, expected, files, capsys, monkeypatch):
    monkeypatch.chdir(files)
    try:
        rc = main(argv)
    except SystemExit as stop:  # argparse
        rc = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("hetrain"), err
    assert "Traceback" not in err
    assert expected in lines[0], lines[0]


def test_several_bad_fields_are_joined_on_one_line():
    err = ValueError("invalid cluster file c.yaml:\n  - machines.0.bandwidth: must be positive\n  - name: required")
    assert one_line(err) == "invalid cluster file c.yaml: machines.0.bandwidth: must be positive; name: required"
