"""Machines with several workers (`gpus: N` of emulated devices): the local workers add
their gradients, one of them pushes each partition, and the result is still the
single-process update on the global batch (real processes through the launcher, gloo
standing in for NCCL in the local groups)."""
import sys

import pytest
import torch
import yaml

from hetrain.cli import main
from tests.helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from reference import single_process  # noqa: E402

# machine a: two emulated GPUs (two workers), machine b: one; unequal batches 4, 8, 12
MIXED = {"name": "hier", "machines": [
    {"name": "a", "role": "worker", "device": {"speed": 1.0}, "gpus": 2},
    {"name": "b", "role": "worker", "device": {"speed": 0.5}},
    {"name": "c0", "role": "cpu"}]}
TWO_BY_TWO = {"name": "hier2", "machines": [
    {"name": "a", "role": "worker", "device": {"speed": 1.0}, "gpus": 2},
    {"name": "b", "role": "worker", "device": {"speed": 0.5}, "gpus": 2},
    {"name": "c0", "role": "cpu"}]}


@pytest.mark.slow
def test_hierarchical_overlapped_training_matches_single_process(launch, tmp_path):
    out = tmp_path / "params"
    # --overlap: gradient hooks start the local reduces during backward, last layers first
    # --broadcast: ranks 1, 2 start perturbed and take rank 0's parameters (tensor by tensor);
    # --skip-sync: synchronize, clip, step inside skip_synchronize (no second exchange)
    rc, log, _ = launch("equiv_train.py", str(out), "--broadcast", "--skip-sync", "--show-collective", cluster=MIXED,
                        mode="byteps", extra=("--partition-bytes", "2048", "--overlap"))
    assert rc == 0, log
    assert "3 workers + 3 summation servers" in log
    # machine a's two workers reduce and broadcast on work buffers in their shared segments
    assert log.count("collective ShmCollective buckets in shared memory") == 2, log
    assert log.count("exchanges 6 in 6 steps") == 3, log
    ref = single_process()
    for r in range(3):
        got = torch.load(out / f"rank{r}.pt")
        for name, want in ref.items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")


@pytest.mark.slow
def test_hierarchical_layouts_weights_and_sums(launch):
    """New layouts mid-job, a zero batch on one local worker, plain sums: each worker checks
    every result against the values it can compute for all ranks."""
    rc, log, _ = launch("relayout.py", cluster=TWO_BY_TWO, mode="byteps", extra=("--partition-bytes", "1024"))
    assert rc == 0, log
    assert log.count("relayout ok on rank") == 4, log


def test_launch_refuses_gpus_the_node_lacks(tmp_path, capsys):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:  # pragma: no cover
        pytest.skip("this host has 64 GPUs")
    cluster = {"machines": [{"name": "g", "role": "worker", "device": {"cuda": True}, "gpus": 64}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster))
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never started')\n")
    assert main(["launch", "--cluster", str(path), str(script)]) == 2
    err = capsys.readouterr().err
    assert "never started" not in err
    assert "machine g asks for 64 GPU(s)" in err and "lower `gpus`" in err and "Traceback" not in err


def test_launch_refuses_nccl_without_gpus(tmp_path, capsys):
    cluster = {"machines": [{"name": "e", "role": "worker", "device": {}, "gpus": 2}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster))
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never started')\n")
    assert main(["launch", "--cluster", str(path), "--mode", "allreduce", "--collective", "nccl", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--collective nccl needs every worker on a CUDA GPU" in err and "machine(s) e" in err


def test_bad_timeouts_are_refused_at_the_command_line(capsys):
    for bad in ("nan", "inf", "-1"):
        assert main(["launch", "--timeout", bad, "x.py"]) == 2
        assert "is not a positive finite number" in capsys.readouterr().err
