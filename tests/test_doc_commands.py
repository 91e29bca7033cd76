"""The shell commands the docs show run as written, so the docs stay true.

Every ```bash block of README.md, docs/user-guide.md and docs/deploy.md is run as one
bash script (`set -e`, so any command that fails fails the block), in a scratch folder
holding links to the repository's top-level entries (the commands' relative paths
resolve, and what they write stays out of the tree). Which lines run is decided by two
listed rules, per line:

- EXCLUDED: commands that need what a test machine has not (other machines, a Ray or
  Kubernetes cluster, a container engine, the network, CUDA), and the install lines;
  each rule names its reason. Slurm's recipe runs through a real Slurm in
  tests/test_deploy.py.
- SLOW: commands that start a training job (`hetrain demo`, `launch`, `train`,
  `torchrun`, `report` of such a run): run by the slow test, marked `long` (minutes;
  `python -m pytest -m long`, not in the default run). The fast test runs each
  block's other lines (planning, simulation, profiling) in CI, each block within a
  short timeout.

Every file a command names (`.yaml`, `.py`, `.json` argument) must be a shipped file or
one an earlier line of the same block writes, excluded lines included.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass

import pytest

from tests.helpers import ROOT, repo_env

DOCS = ("README.md", "docs/user-guide.md", "docs/deploy.md")

# (pattern, reason): a line matching is not run, for that reason
EXCLUDED = (
    (r"^pip install\b", "installs packages (needs the network; the first README block is what CI itself runs)"),
    (r"\bray start\b|--ray\b|--backend ray\b", "needs a Ray cluster"),
    (r"^(sbatch|srun)\b", "needs Slurm (tests/test_deploy.py runs the recipe through a real one-node Slurm)"),
    (r"^kubectl\b", "needs a Kubernetes cluster with Kubeflow Trainer and Kueue"),
    (r"^docker\b", "needs a container engine and the network"),
    (r"--devices real\b|--nproc-per-node gpu\b", "needs CUDA"),
    (r"^tensorboard\b", "a server that runs until stopped"),
)
# (pattern, why): a line matching runs only in the slow test
SLOW = (
    (r"^(\S+=\S+ )*(hetrain (demo|launch|train)\b|torchrun\b)", "starts a training job"),
    (r"^hetrain report\b", "reads a training job's run"),
    (r"--planner rl\b|hetrain\.pipeline\.workload\b",
     "profiles a model on this host, or trains the RL planner (minutes on a small shared host)"),
)
BLOCK_TIMEOUT_S = {"fast": 300, "slow": 2400}


@dataclass(frozen=True)
class Line:
    text: str  # one command, continuation lines joined, comment removed
    doc: str
    lineno: int

    @property
    def excluded(self) -> str | None:
        return next((why for pattern, why in EXCLUDED if re.search(pattern, self.text)), None)

    @property
    def slow(self) -> bool:
        return any(re.search(pattern, self.text) for pattern, _ in SLOW)

    def files(self) -> list[str]:
        """The file arguments of this line (`.yaml`, `.py`, `.json`...)."""
        try:
            words = shlex.split(self.text)
        except ValueError:
            words = self.text.split()
        return [w for w in words if FILE_ARG.match(w)]


def _strip_comment(line: str) -> str:
    """The line without its trailing `# comment` (a '#' at the start or after a blank,
    outside quotes), as bash reads it."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def blocks(doc: str) -> list[tuple[int, list[Line]]]:
    """The ```bash blocks of `doc`: (line number, commands)."""
    text = (ROOT / doc).read_text()
    out = []
    for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        first = text[:m.start()].count("\n") + 2
        lines, pending, start = [], "", first
        for i, raw in enumerate(m.group(1).splitlines()):
            stripped = _strip_comment(raw).strip()
            if not pending:
                start = first + i
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            command = (pending + stripped).strip()
            pending = ""
            if command:
                lines.append(Line(command, doc, start))
        out.append((first, lines))
    return out


def _cases():
    for doc in DOCS:
        for first, lines in blocks(doc):
            yield pytest.param(doc, first, lines, id=f"{doc}:{first}")


ALL = list(_cases())


def test_the_docs_have_commands():
    assert {p.values[0] for p in ALL} == set(DOCS)
    assert sum(1 for p in ALL for line in p.values[2] if not line.excluded) >= 20


FILE_ARG = re.compile(r"^[\w./<>-]+\.(yaml|yml|py|json|sbatch)$")


@pytest.mark.parametrize("doc, first, lines", ALL)
def test_every_file_a_command_names_is_shipped(doc, first, lines):
    made: set[str] = set()
    for line in lines:
        try:
            words = shlex.split(line.text)
        except ValueError:
            words = line.text.split()
        for i, w in enumerate(words):
            if not FILE_ARG.match(w) or w in made:
                continue
            before = words[i - 1] if i else ""
            if before in ("--out", "-o") or (words[:3] == ["python", "-m", "hetrain.pipeline.workload"] and i == 3):
                made.add(w)  # written by this line, read by later ones
                continue
            assert (ROOT / w).exists(), f"{doc}:{line.lineno}: `{line.text}` names {w}, which is not shipped"


def _scratch(tmp_path):
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "runs"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def _script(lines: list[Line], mode: str) -> str | None:
    """The block's lines that `mode` runs, as one bash script; in the fast mode, a line
    that reads a file only a skipped (slow) line writes is skipped too."""
    keep, unmade = [], set()
    for ln in lines:
        if ln.excluded:
            continue
        if mode == "fast" and (ln.slow or unmade & set(ln.files())):
            unmade |= set(ln.files())
            continue
        keep.append(ln)
    commands = [ln for ln in keep if not re.match(r"^(export|wait)\b", ln.text)]
    if not commands or (mode == "slow" and not any(ln.slow for ln in keep)):
        return None  # nothing of this kind here (the other test runs it)
    body = "\n".join(f"echo '+ {ln.doc}:{ln.lineno}: {ln.text.replace(chr(39), '')}'\n{ln.text}" for ln in keep)
    return "set -euo pipefail\n" + _WAIT + body + "\n"


# bash's bare `wait` returns 0 whatever the background commands did; the docs' `wait`
# here fails when any of them failed
_WAIT = 'wait() { local rc=0 p; for p in $(jobs -p); do builtin wait "$p" || rc=$?; done; return $rc; }\n'


def _run_block(tmp_path, lines, mode):
    script = _script(lines, mode)
    if script is None:  # every line needs what this host lacks (`_with` leaves out the other mode's blocks)
        reasons = sorted({ln.excluded for ln in lines if ln.excluded})
        pytest.skip(f"every line of this block is excluded: {'; '.join(reasons)}")
    env = repo_env()
    env["PATH"] = f"{_bin(tmp_path)}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "-c", script], cwd=_scratch(tmp_path / "work"), env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S[mode])
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


def _bin(tmp_path):
    """`hetrain` on PATH, running this tree (the installed entry point may be another checkout's)."""
    import sys

    d = tmp_path / "bin"
    d.mkdir()
    (d / "hetrain").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m hetrain.cli \"$@\"\n")
    (d / "hetrain").chmod(0o755)
    (d / "python").symlink_to(sys.executable)
    (tmp_path / "work").mkdir()
    return d


def _with(mode: str) -> list:
    """The blocks that have commands `mode` runs, or that are excluded whole (those skip,
    saying what they need); a block whose commands all belong to the other mode is that
    test's alone."""
    return [p for p in ALL if _script(p.values[2], mode) is not None or all(ln.excluded for ln in p.values[2])]


@pytest.mark.parametrize("doc, first, lines", _with("fast"))
def test_documented_commands_run_fast_part(tmp_path, doc, first, lines):
    _run_block(tmp_path, lines, "fast")


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("doc, first, lines", _with("slow"))
def test_documented_commands_run(tmp_path, doc, first, lines):
    _run_block(tmp_path, lines, "slow")


def test_the_guide_shows_the_shipped_lab_yaml():
    guide = (ROOT / "docs/user-guide.md").read_text()
    section = guide[guide.index("## Cluster files"):]
    shown = section[section.index("```yaml\n") + 8:section.index("```", section.index("```yaml\n") + 8)]
    shipped = "".join(line for line in (ROOT / "examples/clusters/lab.yaml").read_text().splitlines(keepends=True)
                      if not line.startswith("# "))
    assert shown == shipped
