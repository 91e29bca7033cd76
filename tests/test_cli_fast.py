"""Mistakes are answered before torch is imported, in words that say what to write, and
a crash in the user's script shows its traceback once, from the script's own frames."""
import subprocess
import sys
import textwrap

import pytest

from hetrain.cluster.spec import ClusterSpecError, parse_cluster
from tests.helpers import SCRIPTS, repo_env

SCRIPT = str(SCRIPTS / "steps.py")


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=repo_env(),
                          capture_output=True, text=True, timeout=120)


def test_launch_checks_everything_before_torch_is_imported(tmp_path):
    # a valid launch: every check passes, and the launcher is reached with torch not yet loaded
    (tmp_path / "two.yaml").write_text("machines:\n  - {name: w0, role: worker, device: {speed: 1.0}}\n"
                                       "  - {name: w1, role: worker, device: {speed: 0.5}}\n")
    proc = _run(f"""
        import sys
        import hetrain.cli as cli
        import hetrain.runtime.launch as launch
        seen = []
        launch.launch = lambda cfg: seen.append(("torch" in sys.modules, len(cfg.cluster.workers))) or 0
        assert cli.main(["launch", "--cluster", "two.yaml", {SCRIPT!r}]) == 0
        assert cli.main(["launch", "--nproc-per-node", "3", {SCRIPT!r}]) == 0
        assert cli.main(["demo", "--cluster", "two.yaml", "--epochs", "1"]) == 0
        print(seen)
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(False, 2), (False, 3), (False, 2)]"


@pytest.mark.parametrize("args", [
    ["launch", "--cluster", "speed.yaml", SCRIPT],
    ["launch", "--cluster", "missing.yaml", SCRIPT],
    ["launch", "--nproc-per-node", "2", "nosuch.py"],
    ["launch", "-m", "no.such.module"],
    ["demo", "--cluster", "speed.yaml"],
])
def test_bad_input_answers_without_importing_torch(tmp_path, args):
    (tmp_path / "speed.yaml").write_text("machines:\n  - {name: w0, role: worker, device: {speed: 2.0}}\n")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "hetrain.cli", *args], cwd=tmp_path,
                          env=repo_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "hetrain.errors" in imported and "torch" not in imported
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert len(errors) == 1 and errors[0].startswith("hetrain")


def test_a_speed_above_one_says_what_to_write():
    with pytest.raises(ClusterSpecError) as err:
        parse_cluster({"machines": [{"name": "w0", "role": "worker", "device": {"speed": 2.0}}]}, "lab.yaml")
    text = str(err.value)
    assert "machines.0.device.speed: 2.0 is out of range; write a number at most 1" in text
    assert "`speed: 1.0` and `speed: 0.5`" in text
    assert "Input should be" not in text


def test_numbers_in_the_wrong_form_name_the_form():
    with pytest.raises(ClusterSpecError) as err:
        parse_cluster({"machines": [{"name": "w0", "role": "worker", "node": -1, "device": {"speed": "fast"}}]}, "f")
    text = str(err.value)
    assert "machines.0.device.speed: 'fast' is not a number; write a number" in text
    assert "machines.0.node: -1 is out of range; write a number at least 0" in text


def test_a_script_traceback_starts_at_the_script(tmp_path):
    (tmp_path / "crash.py").write_text("def f():\n    raise ValueError('boom')\n\nf()\n")
    proc = subprocess.run([sys.executable, "-m", "hetrain.runtime.script", "crash.py"], cwd=tmp_path,
                          env=repo_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert 'File "crash.py", line 4, in <module>' in lines[1]
    assert lines[-1] == "ValueError: boom"
    assert "runpy" not in proc.stderr and "hetrain" not in proc.stderr
    assert proc.stderr.count("Traceback") == 1


def test_a_crashed_job_shows_the_traceback_once(tmp_path):
    (tmp_path / "crash.py").write_text("import hetrain\nhetrain.init()\n\ndef f():\n    raise ValueError('boom')\n\n"
                                       "f()\n")
    proc = subprocess.run([sys.executable, "-m", "hetrain.cli", "launch", "--nproc-per-node", "1", "crash.py"],
                          cwd=tmp_path, env=repo_env(), capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.count("raise ValueError('boom')") == 1, out
    assert "runpy" not in out and "hetrain/runtime/script.py" not in out
    assert "job failed: rank 0 (worker on machine w0) (exit code 1). Its last line (its output is above): " \
           "[rank0]: ValueError: boom" in out or "Its last line (its output is above): ValueError: boom" in out
