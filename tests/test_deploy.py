"""The deploy recipes in examples/deploy/: the sbatch script through a real one-node
Slurm (slurmctld + slurmd on this host, bench/slurm_local.py), the TrainJob manifest
and the container recipe read as their tools read them."""
import importlib.util
import os
import re
import sys

import pytest
import yaml

from tests.helpers import ROOT, pythonpath

DEPLOY = ROOT / "examples" / "deploy"


def _slurm_local():
    spec = importlib.util.spec_from_file_location("bench_slurm_local", ROOT / "bench" / "slurm_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.long
def test_the_sbatch_recipe_runs_on_a_real_slurm(tmp_path):
    slurm = _slurm_local()
    why = slurm.install()  # apt-get install slurm-wlm munge where missing (root); why not, where it cannot
    if why:
        pytest.skip(why)
    env = {"PYTHONPATH": pythonpath(), "HETRAIN": f"{sys.executable} -m hetrain.cli"}
    res = slurm.run_recipe([], tmp_path, env)
    assert res["exit"] == 0, res["output"]
    assert "digits demo: test accuracy" in res["output"]
    assert "hetrain: all 2 processes finished" in res["output"]


def test_the_sbatch_recipe_runs_one_launcher_per_node():
    text = (DEPLOY / "hetrain.sbatch").read_text()
    assert text.startswith("#!/bin/bash\n")
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and "--ntasks-per-node=1" in srun[0] and " launch " in srun[0]
    assert "--node-rank" not in srun[0] and "--master-addr" not in srun[0]  # from Slurm's variables
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", text, re.M)


def test_the_trainjob_manifest_is_queued_by_kueue_and_carries_no_rendezvous_flags():
    job = yaml.safe_load((DEPLOY / "trainjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"  # the runtime that sets PET_*
    trainer = job["spec"]["trainer"]
    assert trainer["command"][:2] == ["hetrain", "launch"] and trainer["numNodes"] >= 2
    assert not {"--node-rank", "--master-addr", "--nnodes"} & set(trainer["command"])
    assert any(e["name"] == "HETRAIN_SECRET" and "secretKeyRef" in e["valueFrom"] for e in trainer["env"])


def test_the_container_recipe_copies_what_exists_and_has_both_bases():
    text = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    assert "ARG BASE=python:" in text and "--build-arg BASE=pytorch/pytorch:" in text and "cuda" in text
    assert re.search(r"torch==\$\{TORCH_VERSION\}", text) and "ARG TORCH_VERSION=" in text
    assert os.access(DEPLOY / "hetrain.sbatch", os.X_OK)
