"""Lightning's Trainer under HetrainStrategy, in real processes started by hetrain's
launcher: per-worker shares follow the emulated speeds, and the weights after two
epochs equal one process's on the same global batches."""
import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.helpers import SCRIPTS, repo_env

sys.path.insert(0, str(SCRIPTS))
from reference import GLOBAL_BATCH, single_process  # noqa: E402

# the test extra installs Lightning: without it these tests fail, they are not skipped
assert importlib.util.find_spec("lightning") is not None, \
    "tests/test_lightning.py needs Lightning, which the test extra installs: pip install -e '.[test]'"

SAMPLES, EPOCHS = 200, 2
STEPS = -(-SAMPLES // GLOBAL_BATCH)  # per epoch: 8 global batches of 24 and a last one of 8


def cluster(speeds: list[float], cpus: int) -> dict:
    return {"name": "lightning", "machines": [{"name": f"w{i}", "role": "worker", "device": {"speed": s}}
                                              for i, s in enumerate(speeds)]
            + [{"name": f"c{j}", "role": "cpu"} for j in range(cpus)]}


def check_run(out, speeds: list[float], strategy: str = "HetrainStrategy") -> torch.Tensor:
    """Every worker ended with one process's parameters on the same global batches,
    agreed on every share, trained each sample of each step once; returns the shares."""
    n = len(speeds)
    runs = [torch.load(out / f"rank{r}.pt") for r in range(n)]
    orders = runs[0]["orders"]
    ref = single_process([orders[e][s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
                          for e in range(EPOCHS) for s in range(STEPS)])
    for r, got in enumerate(runs):
        assert got["strategy"] == strategy and got["world"] == n  # summation servers are not in Lightning's world
        assert got["global_step"] == EPOCHS * STEPS
        assert got["speed"] == speeds[r]  # each worker ran at its machine's emulated speed
        for name, want in ref.items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
    assert all(torch.equal(torch.stack(r["orders"]), torch.stack(orders)) for r in runs)
    trained = torch.stack([r["trained"] for r in runs])  # workers x steps
    last = SAMPLES - (STEPS - 1) * GLOBAL_BATCH
    assert trained.sum(0).tolist() == ([GLOBAL_BATCH] * (STEPS - 1) + [last]) * EPOCHS
    # validation ran on Lightning's equal DistributedSampler and its logged loss was reduced
    # over the workers (sync_dist): the same number everywhere
    assert len({r["val_loss"] for r in runs}) == 1
    sizes = runs[0]["sizes"]
    assert all(torch.equal(r["sizes"], sizes) for r in runs)  # every worker agreed on every share
    assert torch.all(sizes.sum(1) == GLOBAL_BATCH)
    return sizes


@pytest.mark.slow
def test_trainer_in_one_plain_process(tmp_path):
    """`python train.py` without the launcher is a one-worker job: the Trainer runs
    strategy="hetrain" and the closure Lightning passes to optimizer.step runs its
    backward before the (one-worker) exchange, so the update is plain SGD's."""
    out = tmp_path / "params"
    run = subprocess.run([sys.executable, str(SCRIPTS / "lightning_train.py"), str(out), "--by-name"],
                         env=repo_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    sizes = check_run(out, [1.0])
    assert sizes.flatten().tolist() == [GLOBAL_BATCH] * len(sizes)


@pytest.mark.slow
def test_trainer_two_workers_shares_follow_speed_and_weights_equal_one_process(launch, tmp_path):
    out = tmp_path / "params"
    rc, log, _ = launch("lightning_train.py", str(out), cluster=cluster([1.0, 0.5], cpus=0), mode="allreduce",
                        timeout=60)
    assert rc == 0, log
    sizes = check_run(out, [1.0, 0.5], "HetrainStrategy")
    assert tuple(sizes[0].tolist()) == (12, 12)  # the DataLoader's batch_size x 2 workers, equal until measured
    assert sizes[-1, 0] > sizes[-1, 1] and abs(int(sizes[-1, 0]) - 16) <= 2, sizes  # 1 : 0.5 (ideal 16, 8)


@pytest.mark.slow
def test_trainer_by_name_three_workers_with_summation_servers(launch, tmp_path):
    """strategy="hetrain" (Lightning's registry), mode byteps: the exchange goes through a
    CPU machine's summation server and the workers' co-located ones."""
    out = tmp_path / "params"
    rc, log, _ = launch("lightning_train.py", str(out), "--by-name", cluster=cluster([1.0, 0.5, 0.25], cpus=1),
                        timeout=60)
    assert rc == 0, log
    sizes = check_run(out, [1.0, 0.5, 0.25], "HetrainStrategy")
    assert tuple(sizes[0].tolist()) == (8, 8, 8)
    assert sizes[-1, 0] > sizes[-1, 1] > sizes[-1, 2], sizes  # 1 : 0.5 : 0.25 (ideal 13.7, 6.9, 3.4)
    assert abs(int(sizes[-1, 0]) - 13.7) <= 2, sizes


@pytest.mark.slow
def test_bad_uses_get_a_message_saying_what_to_do(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPTS / "lightning_errors.py")], env=repo_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    said = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert "global_batch=256" in said["global_batch"]
    assert "balance='measured'" in said["balance"]
    assert "HetrainStrategy(global_batch=N)" in said["accumulate"]
    assert "hetrain.SyncBatchNorm" in said["sync_batchnorm"]
    assert "map-style" in said["iterable"]
