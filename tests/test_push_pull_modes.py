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
