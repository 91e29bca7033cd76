"""Scripts written the way Horovod's and BytePS's own examples are (examples/horovod,
examples/byteps) run under `hetrain launch` with only their import line changed:
synthetic benchmark (average and Adasum), MNIST-style training with metric averaging,
ImageNet-style training with checkpoint resume and the epoch broadcast, elastic training
with TorchState through a worker failure, and two BytePS scripts."""
import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import repo_env, small_cluster

ROOT = Path(__file__).parents[1]
SCRIPTS = sorted((ROOT / "examples" / "horovod").glob("*.py")) + sorted((ROOT / "examples" / "byteps").glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_only_the_import_line_names_hetrain(path):
    """The scripts are Horovod/BytePS scripts: hetrain appears in code only as the module
    imported under Horovod's or BytePS's name."""
    tree = ast.parse(path.read_text())
    alias = "hvd" if path.parent.name == "horovod" else "bps"
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               and any("hetrain" in (a.name or "") for a in n.names) or isinstance(n, ast.ImportFrom)
               and "hetrain" in (n.module or "")]
    assert len(imports) == 1 and isinstance(imports[0], ast.Import), path
    assert [(a.name, a.asname) for a in imports[0].names] == [("hetrain", alias)]
    assert not any(isinstance(n, ast.Name) and n.id == "hetrain" for n in ast.walk(tree))


def _launch(tmp_path, script, *args, flags=()):
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(small_cluster(workers=2, cpus=1)))
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "allreduce",
           "--timeout", "20", "--run-dir", str(tmp_path / "run"), *flags, str(script), *args]
    env = repo_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env, cwd=tmp_path)
    return proc.returncode, proc.stdout + proc.stderr


def _same_on_both(a, b, keys, what):
    for k in keys:
        assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (what, k, a[k], b[k])


@pytest.mark.slow
def test_horovod_and_byteps_examples_run_unchanged(tmp_path):
    out = tmp_path / "res"
    rc, log = _launch(tmp_path, ROOT / "tests" / "scripts" / "run_ported.py", str(out))
    assert rc == 0, log
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    assert [x["script"] for x in r0] == [x["script"] for x in r1]
    for a, b in zip(r0, r1):  # the workers agree: same weights, same averaged metrics
        keys = [k for k in ("total", "weights_sum", "loss", "accuracy", "seen", "resumed_from") if k in a]
        _same_on_both(a, b, keys, (a["script"], a["args"]))
    bench, adasum, mnist, ck1, ck2, bps_bench, bps_mnist = r0
    assert bench["total"] > 0 and adasum["total"] > 0
    assert mnist["loss"] < math.log(10) and 0.3 < mnist["accuracy"] <= 1.0
    assert (ck1["resumed_from"], ck2["resumed_from"]) == (0, 1)  # the second run resumed from epoch 1
    assert (out / "ck-2.pt").exists()
    assert bps_mnist["seen"] == 1400 and bps_mnist["loss"] < math.log(10)
    assert "Total img/sec on 2 worker(s)" in log


@pytest.mark.slow
def test_horovod_elastic_example_survives_a_lost_worker(tmp_path):
    marker = tmp_path / "failed-once"
    rc, log = _launch(tmp_path, ROOT / "examples" / "horovod" / "elastic.py", "--epochs", "2", "--fail-once",
                      str(marker), flags=("--max-restarts", "2"))
    assert rc == 0, log
    assert marker.exists() and "resumed from commit" in log, log
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if "RESULT " in line]
    assert len(results) == 2, log
    a, b = results
    _same_on_both(a, b, ["weights_sum"], "elastic")  # losses are of each worker's own last batch
    assert a["resets"] == b["resets"] == [2] and a["epochs"] == 2  # the reset callback ran in the new round
