"""hetrain as a package for an index: `python -m build` gives an sdist and a wheel that
`twine check` accepts, with the license and the package data inside, and the wheel
installs and imports in a fresh virtual environment (away from this tree), its `hetrain`
command included. The supported PyTorch range is declared and stated in the README."""
import importlib.util
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _tools() -> None:
    """build and twine come with the test extra: without them the packaging test fails, it is not skipped."""
    missing = [m for m in ("build", "twine") if importlib.util.find_spec(m) is None]
    assert not missing, f"the packaging test needs {missing}, which the test extra installs: pip install -e '.[test]'"


def test_license_and_torch_range_declared_and_stated():
    assert PROJECT["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n")
    assert all((ROOT / f).is_file() for f in PROJECT["license-files"])
    torch = next(Requirement(d) for d in PROJECT["dependencies"] if d.startswith("torch"))
    # the oldest and newest PyTorch hetrain was run with: the GPU runs' and the tests'
    for tried in ("2.11.0+cu130", "2.13.0+cpu"):
        assert torch.specifier.contains(tried), (str(torch), tried)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Supported PyTorch"):]
    section = section[: section.index("\n## ", 1)]
    assert all(f"{spec.operator}{spec.version}" in section for spec in torch.specifier), (str(torch), section)
    assert "2.11" in section and "2.13" in section
    lightning = [Requirement(d) for d in PROJECT["optional-dependencies"]["lightning"]]
    assert [r.name for r in lightning] == ["lightning"]


def _build(out: Path) -> tuple[Path, Path]:
    # without isolation: the build backend installed here (setuptools, pyproject's
    # build-system) builds it, so the test needs no index; the wheel is built from the
    # sdist, as `python -m build` always does
    run = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, list(out.iterdir())
    return sdists[0], wheels[0]


@pytest.mark.slow
def test_build_twine_check_and_clean_install(tmp_path):
    _tools()
    sdist, wheel = _build(tmp_path / "dist")
    check = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.count("PASSED") == 2, check.stdout + check.stderr

    version = PROJECT["version"]
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = Parser().parsestr(z.read(f"hetrain-{version}.dist-info/METADATA").decode())
    assert meta["License-Expression"] == "Apache-2.0"
    assert {"LICENSE", "hetrain/data/gavel/LICENSE"} <= set(meta.get_all("License-File"))
    assert f"hetrain-{version}.dist-info/licenses/LICENSE" in names
    assert {"hetrain/lightning.py", "hetrain/data/catalogue_aws.yaml", "hetrain/data/gavel/LICENSE"} <= names
    assert not any(n.startswith(("tests/", "bench/")) for n in names)
    assert any(r.startswith("lightning") and "extra == \"lightning\"" in r for r in meta.get_all("Requires-Dist"))
    with tarfile.open(sdist) as t:
        top = f"hetrain-{version}/"
        members = {m.name.removeprefix(top) for m in t.getmembers()}
    assert {"LICENSE", "README.md", "pyproject.toml", "hetrain/__init__.py", "hetrain/lightning.py"} <= members

    # a fresh venv that sees this machine's packages (torch is large) but not this tree
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed",
                              str(wheel)], capture_output=True, text=True, env=env, timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    probe = ("import hetrain, hetrain.cluster.spec, hetrain.plan, importlib.resources as r; "
             "print(hetrain.__file__); print(hetrain.__version__); "
             "print(r.files('hetrain').joinpath('data/catalogue_aws.yaml').is_file())")
    got = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert got.returncode == 0, got.stderr
    where, got_version, data = got.stdout.split()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where  # the installed copy, not this tree
    assert got_version == version and data == "True"
    cli = subprocess.run([str(venv / "bin" / "hetrain"), "--help"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert cli.returncode == 0 and "launch" in cli.stdout, cli.stdout + cli.stderr
