"""Installing hetrain keeps the PyTorch a machine already has; the README opens with the
two set-up commands, and CI runs the second of them; the processes the tests and benches
launch keep the dependencies that the caller's PYTHONPATH reaches."""
import os
import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests.helpers import repo_env

ROOT = Path(__file__).parents[1]


def test_torch_is_a_range_not_a_pin():
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    torch = next(r for r in deps if r.name == "torch")
    # CUDA and CPU builds of any 2.x from 2.1 on are kept as they are
    for installed in ("2.1.0", "2.5.1+cu121", "2.13.0+cpu", "2.14.1"):
        assert torch.specifier.contains(installed), (str(torch), installed)
    # 2.0 lacks register_post_accumulate_grad_hook (overlap)
    for refused in ("2.0.1", "1.13.1", "3.0.0"):
        assert not torch.specifier.contains(refused), (str(torch), refused)


def _readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block.start() < text.index("\n## "), "the README must open with its set-up commands"
    return [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_setup_commands_and_ci_runs_the_second():
    demo, tests = _readme_setup_commands()
    assert demo == "pip install torch==2.13.0 -e . && hetrain demo"
    # two pytest workers, a file's tests on one (the suite is bound by process start-up)
    assert tests == "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q -n 2 --dist loadgroup"
    ci = (ROOT / ".ci" / "run").read_text()
    # .ci/run extracts the command from the README; check its extraction gives the same
    script = ci[ci.index("test_cmd=") + len("test_cmd="): ci.index("\ncase ")]
    got = subprocess.run(["bash", "-c", f"repo={ROOT}; echo {script}"], capture_output=True, text=True)
    assert got.stdout.strip() == tests, got


def test_launched_processes_keep_the_callers_pythonpath(monkeypatch):
    """Dependencies installed with `pip install --target DIR` are reached through
    PYTHONPATH=DIR only: `repo_env` (bench/pinned_pair.py, which the tests use too) puts
    the tree before it."""
    root, outer, front = str(ROOT.resolve()), "/outer/site", "/stand/in"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([outer, "", root]))
    env = repo_env(front, EXTRA="1")
    assert env["PYTHONPATH"].split(os.pathsep) == [front, root, outer] and env["EXTRA"] == "1"
    assert repo_env()["PYTHONPATH"].split(os.pathsep) == [root, outer]
    monkeypatch.delenv("PYTHONPATH")
    assert repo_env()["PYTHONPATH"] == root
