"""Every communication mode gives the single-process update on the global batch,
with unequal per-worker batch sizes (real processes, gloo)."""
import sys

import pytest
import torch

from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
from reference import single_process  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["byteps", "byteps-lanes", "ps", "colocated", "allreduce"])
def test_mode_matches_single_process(launch, mode, tmp_path):
    out = tmp_path / "params"
    # tiny partitions: the 11 KB gradient spans many partitions and rounds;
    # byteps-lanes: the CPU server's partitions travel over 2 parallel connections
    lanes = ("--max-lanes", "4") if mode == "byteps-lanes" else ()
    rc, log, _ = launch("equiv_train.py", str(out), mode=mode.split("-")[0], extra=("--partition-bytes", "2048", *lanes),
                        cluster=small_cluster(workers=3, cpus=1))
    assert rc == 0, log
    ref = single_process()
    for r in range(3):
        got = torch.load(out / f"rank{r}.pt")
        for name, want in ref.items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=f"{mode} rank {r} {name}")


@pytest.mark.slow
def test_ddp_comm_hook_matches_single_process(launch, tmp_path):
    out = tmp_path / "params"
    rc, log, _ = launch("equiv_train.py", str(out), "--ddp", mode="byteps", extra=("--partition-bytes", "2048"))
    assert rc == 0, log
    ref = single_process()
    for r in range(2):
        got = torch.load(out / f"rank{r}-ddp.pt")
        for name, want in ref.items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["byteps", "allreduce"])
def test_layout_changes_weights_and_sums(launch, mode):
    """New layouts mid-job (servers had already posted receives for the old one), a
    worker with weight 0, and average=False: each worker checks every result."""
    rc, log, _ = launch("relayout.py", mode=mode, extra=("--partition-bytes", "1024"),
                        cluster=small_cluster(workers=3, cpus=1))
    assert rc == 0, log
    assert log.count("relayout ok on rank") == 3, log


@pytest.mark.slow
def test_all_reduce_buckets_are_tuned_while_training_and_results_stay_exact(launch, tmp_path):
    """The job's all-reduce tries DDP's two buckets and one bucket in mirrored blocks of
    a few steps, and both workers switch at the same steps and keep the same plan; the
    gradients change buckets three times or more (their homes move) and the model still
    equals one process on the global batches, with gloo's socket threads lowered
    (`--gloo-thread idle`: every group's, those named after init() looked included)."""
    from bucket_tuning import reference

    cluster = {"name": "t", "machines": [{"name": f"w{i}", "role": "worker", "device": {}} for i in range(2)]}
    out = tmp_path / "res"
    rc, log, _ = launch("bucket_tuning.py", str(out), cluster=cluster, mode="allreduce", timeout=60,
                        extra=("--gloo-thread", "idle"))
    assert rc == 0, log
    runs = [torch.load(f"{out}.rank{r}.pt") for r in range(2)]
    for r in runs:
        assert len(r["loop_idle"]) >= 2 and all(r["loop_idle"]), r["loop_idle"]  # one thread per gloo group
    assert runs[0]["buckets"] == runs[1]["buckets"] and runs[0]["times"] == runs[1]["times"]
    assert runs[0]["done"] and runs[0]["tried"] == 2
    # DDP's plan for 2 + 5 steps, one bucket for 10, DDP's for 5, then the one measured faster
    assert runs[0]["buckets"][:22] == [2] * 6 + [1] * 10 + [2] * 5 + runs[0]["buckets"][21:22]
    assert len(set(runs[0]["buckets"][21:])) == 1
    want = reference()
    for r in runs:
        for name, value in want.items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)
