"""Every command, fed bad input, answers with exit code 2 and one line on stderr, no
traceback, and starts nothing."""
import subprocess
import sys

import pytest
import yaml

from hetrain.cli import main
from tests.helpers import SCRIPTS, repo_env, small_cluster


@pytest.fixture
def files(tmp_path):
    (tmp_path / "broken.yaml").write_text("machines: [\n")
    (tmp_path / "broken.json").write_text('{"stages": [')
    (tmp_path / "notaplan.json").write_text("{}")
    (tmp_path / "nomachines.yaml").write_text("name: lab\n")
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(small_cluster(workers=2, cpus=1)))
    greedy = small_cluster(workers=2, cpus=0)
    greedy["machines"][0]["threads"] = 4096
    (tmp_path / "greedy.yaml").write_text(yaml.safe_dump(greedy))
    (tmp_path / "empty_run").mkdir()
    return tmp_path


SCRIPT = str(SCRIPTS / "steps.py")
CASES = {
    # launch: flags, files, numbers, torchrun flags
    "launch without a script": ["launch"],
    "launch unknown flag": ["launch", "--bogus", SCRIPT],
    "launch missing script": ["launch", "nosuch.py"],
    "launch missing module": ["launch", "-m", "no.such.module"],
    "launch missing cluster file": ["launch", "--cluster", "{d}/missing.yaml", SCRIPT],
    "launch malformed YAML": ["launch", "--cluster", "{d}/broken.yaml", SCRIPT],
    "launch cluster without machines": ["launch", "--cluster", "{d}/nomachines.yaml", SCRIPT],
    "launch bad number": ["launch", "--timeout", "abc", SCRIPT],
    "launch negative timeout": ["launch", "--timeout", "-1", SCRIPT],
    "launch bad mode": ["launch", "--mode", "ring", SCRIPT],
    "launch bad nproc": ["launch", "--nproc-per-node", "many", SCRIPT],
    "launch elastic nnodes": ["launch", "--nnodes", "1:4", SCRIPT],
    "launch bad endpoint": ["launch", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:port", SCRIPT],
    "launch multi-node without master": ["launch", "--nnodes", "2", "--nproc_per_node", "2", SCRIPT],
    "launch flags contradict cluster": ["launch", "--cluster", "{d}/two.yaml", "--nproc-per-node", "3", SCRIPT],
    "launch standalone with nnodes": ["launch", "--standalone", "--nnodes", "2", SCRIPT],
    "launch node rank out of range": ["launch", "--cluster", "{d}/two.yaml", "--node-rank", "5", SCRIPT],
    "launch too many threads": ["launch", "--cluster", "{d}/greedy.yaml", SCRIPT],
    "launch unknown rdzv backend": ["launch", "--rdzv-backend", "etcd", SCRIPT],
    "launch missing plan": ["launch", "--plan", "{d}/missing.json"],
    "launch not a whole-job plan": ["launch", "--plan", "{d}/notaplan.json"],
    "launch plan and auto": ["launch", "--plan", "{d}/notaplan.json", "--auto", SCRIPT],
    "launch auto without a script": ["launch", "--auto"],
    "launch auto too few steps": ["launch", "--auto", "--auto-steps", "1", SCRIPT],
    # demo
    "demo bad number": ["demo", "--epochs", "x"],
    "demo missing cluster file": ["demo", "--cluster", "{d}/missing.yaml"],
    "demo malformed YAML": ["demo", "--cluster", "{d}/broken.yaml"],
    # netns
    "netns without action": ["netns"],
    "netns unknown action": ["netns", "bogus"],
    # plan
    "plan missing flags": ["plan"],
    "plan neither cluster nor catalogue": ["plan", "--model", "cnn"],
    "plan cluster and catalogue": ["plan", "--model", "cnn", "--cluster", "{d}/two.yaml", "--catalogue", "aws"],
    "plan target and budget": ["plan", "--model", "digits", "--cluster", "{d}/two.yaml", "--cost-per-sample", "0.001",
                               "--target-throughput", "5", "--budget", "3"],
    "plan demo without cost": ["plan", "--model", "digits", "--cluster", "{d}/two.yaml"],
    "plan negative budget": ["plan", "--model", "digits", "--cluster", "{d}/two.yaml", "--budget", "-1"],
    "plan malformed cluster": ["plan", "--model", "digits", "--cluster", "{d}/broken.yaml"],
    "plan negative throughput": ["plan", "--model", "cnn", "--catalogue", "aws", "--throughput", "-5"],
    "plan bad number": ["plan", "--model", "cnn", "--catalogue", "aws", "--throughput", "fast"],
    "plan unknown model": ["plan", "--model", "nosuch", "--catalogue", "aws", "--throughput", "5"],
    "plan missing catalogue": ["plan", "--model", "cnn", "--catalogue", "{d}/missing.yaml", "--throughput", "5"],
    "plan malformed catalogue": ["plan", "--model", "cnn", "--catalogue", "{d}/broken.yaml", "--throughput", "5"],
    "plan malformed profile": ["plan", "--model", "{d}/broken.json", "--catalogue", "aws", "--throughput", "5"],
    "plan unknown planner": ["plan", "--model", "cnn", "--catalogue", "aws", "--throughput", "5", "--planner", "x"],
    # schedule
    "schedule without action": ["schedule"],
    "schedule simulate without source": ["schedule", "simulate"],
    "schedule unknown pattern": ["schedule", "simulate", "--pattern", "nosuch"],
    "schedule missing trace": ["schedule", "simulate", "--trace", "{d}/missing.txt"],
    "schedule zero jobs": ["schedule", "simulate", "--pattern", "poisson", "--jobs", "0"],
    "schedule bad pool": ["schedule", "simulate", "--pattern", "poisson", "--cluster", "v100:x"],
    "schedule malformed cluster": ["schedule", "simulate", "--pattern", "poisson", "--cluster", "{d}/broken.yaml"],
    "schedule unknown policy": ["schedule", "run", "--policy", "nope"],
    # train --plan
    "train without plan": ["train"],
    "train missing plan": ["train", "--plan", "{d}/missing.json"],
    "train malformed plan": ["train", "--plan", "{d}/broken.json"],
    "train not a plan": ["train", "--plan", "{d}/notaplan.json"],
    "train bad number": ["train", "--plan", "{d}/notaplan.json", "--steps", "x"],
    # report
    "report without run dir": ["report"],
    "report missing run dir": ["report", "{d}/missing_run"],
    "report run without steps": ["report", "{d}/empty_run"],
    # no such command
    "unknown command": ["frobnicate"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_exit_2(name, files, capsys, monkeypatch):
    import hetrain.runtime.launch.procs as procs

    def no_process(*a, **k):
        raise AssertionError(f"bad input started a process: {a[0] if a else k}")

    # the launcher's one way to start a process (patching subprocess.Popen itself would also
    # stop libraries, e.g. matplotlib's first font scan, that run helpers while importing)
    monkeypatch.setattr(procs, "start_process", no_process)
    argv = [a.replace("{d}", str(files)) for a in CASES[name]]
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse
        rc = exit_.code
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("hetrain") and "error:" in lines[0], err
    assert "Traceback" not in out + err
    assert "hetrain: job" not in out  # the launcher started nothing


def test_launch_of_a_missing_script_starts_nothing(tmp_path):
    """The console command, end to end: refused before any store or process exists."""
    env = repo_env()
    proc = subprocess.run([sys.executable, "-m", "hetrain.cli", "launch", "--run-dir", str(tmp_path / "run"),
                           "nosuch.py"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"hetrain: error: training script nosuch.py does not exist (relative to {tmp_path}); check the path, "
        "or use -m for a module"]
    assert proc.stdout == ""  # no "hetrain: job ..." line: nothing started
    assert not (tmp_path / "run").exists()
