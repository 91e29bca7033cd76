"""Workers that train on no sample leave the gradient exchange (hetrain.api.members): the
others exchange among themselves, a worker that rejoins is re-synchronised first, and the
result is one process's on the same samples, with summation servers or without."""
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
from reference import GLOBAL_BATCH, single_process  # noqa: E402

HERE = Path(__file__).parent / "scripts"
sys.path.insert(0, str(HERE))
from leave_exchange import SETS  # noqa: E402


def _check(out: Path, workers: int = 3, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ref = single_process([torch.arange(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH) for s in range(len(SETS))])
    for r in range(workers):
        got = torch.load(out / f"rank{r}.pt")
        # every worker ends with one process's parameters (those that sat out: brought up to date at the end)
        for name, want in ref.items():
            torch.testing.assert_close(got["params"][name], want, rtol=rtol, atol=atol, msg=f"rank {r} {name}")
        steps_in = sum(r in s for s in SETS)
        assert got["exchanges"] == steps_in and got["sat_out"] == len(SETS) - steps_in, got
        # a worker out of a step's set put nothing on the wire in it, nor one alone in its set
        assert got["moved"] == [r in s and len(s) > 1 for s in SETS], got["moved"]
        # rejoins at step 4 (worker 2) and 6 (workers 0 and 2), and at the end (worker 1)
        assert got["resyncs"] == 3, got


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "byteps"])
def test_left_workers_take_no_part_and_rejoin_resynchronised(launch, tmp_path, mode):
    """A fixed schedule of exchange sets (all, two, all, one, two) over 8 steps: the
    result equals one process on every step's 24 samples; with summation servers (byteps)
    the steps without every worker do not wait for the servers, nor the servers hang."""
    out = tmp_path / "params"
    rc, log, _ = launch(str(HERE / "leave_exchange.py"), str(out), cluster=small_cluster(3, 1 if mode != "allreduce"
                                                                                          else 0), mode=mode,
                        timeout=30, limit=300)
    assert rc == 0, log
    _check(out)


SLOW_THIRD = {"name": "t", "machines": [
    {"name": "w0", "role": "worker", "device": {"speed": 1.0}},
    {"name": "w1", "role": "worker", "device": {"speed": 0.5}},
    {"name": "w2", "role": "worker", "device": {"speed": 0.04}}]}


@pytest.mark.slow
def test_a_balanced_worker_too_slow_to_help_leaves_and_is_probed_on_copies(launch, tmp_path):
    """Through BalancedLoader: a worker 25x slower than the fastest gets a sliver of a share,
    so it sits out and leaves the exchange; probes (every 2 steps here) time it on copies
    of samples the others train on, out of the exchange, its gradients dropped: the others
    keep the whole batch and no re-synchronisation is made for a probe. Every worker ends
    with one process's parameters."""
    from tests.hps.test_hps_multiprocess import HPS, check_one_process_update

    out = tmp_path / "params"
    rc, log, _ = launch(str(HPS / "balanced_train.py"), str(out), "--probe-every=2", cluster=SLOW_THIRD,
                        mode="allreduce", timeout=30, limit=300)
    assert rc == 0, log
    runs = check_one_process_update(out, "unequal", 0.0)  # (the others trained every sample of every step)
    trained = runs[2]["trained"]  # the slow worker's steps: samples, passes, copies
    own = (trained[:, 0] * (1 - trained[:, 2])).tolist()
    out_steps = [k for k, n in enumerate(own) if n == 0]
    assert out_steps, trained  # it sat out ...
    assert runs[2]["sat_out"] == len(out_steps) and runs[2]["exchanges"] == len(own) - len(out_steps)
    probed = [k for k in out_steps if trained[k, 2]]
    assert probed and all(int(trained[k, 0]) > 0 for k in probed), trained  # ... timed on copies while out
    rejoins = sum(1 for k in range(out_steps[0], len(own)) if own[k] > 0 and own[k - 1] == 0)
    assert all(r["resyncs"] == rejoins + int(own[-1] == 0) for r in runs), [r["resyncs"] for r in runs]
    # only a worker sitting out keeps to the trainers' pace: one that trained every step never waited
    for r, run in enumerate(runs):
        if all(run["trained"][:, 0] * (1 - run["trained"][:, 2]) > 0):
            assert run["slept"] == 0.0, (r, run["slept"])


MIXED = {"name": "mixed", "machines": [
    {"name": "g0", "role": "worker", "device": {"cuda": True}},
    {"name": "w1", "role": "worker", "device": {"speed": 1.0}},
    {"name": "w2", "role": "worker", "device": {"speed": 1.0}}]}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_a_gpu_worker_leaves_and_rejoins_resynchronised(launch, tmp_path, mode):
    """The same schedule with worker 0 on the GPU: it trains with the CPU workers, with one
    of them (a gloo group fed from pinned buffers), is out while they train alone, and is
    re-synchronised (CUDA parameters and momentum) when it rejoins."""
    out = tmp_path / "params"
    cluster = {**MIXED, "machines": MIXED["machines"] + ([{"name": "c0", "role": "cpu"}] if mode == "ps" else [])}
    rc, log, _ = launch(str(HERE / "leave_exchange.py"), str(out), "--cuda", cluster=cluster, mode=mode,
                        timeout=90, limit=400)
    assert rc == 0, log
    _check(out, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_a_gpu_worker_leaves_and_rejoins_under_the_cuda_standin(tmp_path, mode):
    """The GPU test's schedule on this host's CUDA stand-in (tests/cudastandin: device
    tensors that are host bytes, and its stream race checker): the GPU worker's staging
    into the gloo group of a set, the GPU alone, its re-synchronisation from the CPU
    workers; no stream race, one process's result."""
    import subprocess

    import yaml

    from tests.helpers import ROOT
    from tests.test_cuda_standin import standin_env

    cluster = {**MIXED, "machines": MIXED["machines"] + ([{"name": "c0", "role": "cpu"}] if mode == "ps" else [])}
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    out = tmp_path / "params"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", mode, "--timeout", "60",
           "--run-dir", str(tmp_path / "run"), str(HERE / "leave_exchange.py"), str(out), "--cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=standin_env(1), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "CUDA stream race" not in proc.stdout + proc.stderr
    assert [torch.load(out / f"rank{r}.pt")["device"] for r in range(3)] == ["cuda:0", "cpu", "cpu"]
    _check(out)


def _same(got: dict, want: dict, what: str, buffers: bool = True, tol: float = 0.0) -> None:
    """Model state (parameters, and buffers unless `buffers=False`) and momentum equal
    (bit for bit where copied: `tol` 0)."""
    for name, t in want["model"].items():
        if not buffers and ("running_" in name or "num_batches" in name):
            continue
        torch.testing.assert_close(got["model"][name], t, rtol=tol, atol=tol, msg=f"{what}: {name}")
    for k, (a, b) in enumerate(zip(got["momentum"], want["momentum"])):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{what}: momentum of parameter {k}")


@pytest.mark.slow
def test_a_commit_while_a_worker_sits_out_holds_the_exchanging_workers_state_and_buffers_follow(launch, tmp_path):
    """Worker 0 sits out of steps 1-2 and commits after step 2 (rank 0 writes a replica of
    every commit, and the lowest rank holding the newest one is restored): both replicas
    hold the exchanging workers' parameters and momentum, and the model's batch-norm
    buffers, those of the rank the rejoining worker is re-synchronised from. When worker 0
    rejoins (steps 3 and 5), its batch-norm statistics are that rank's too."""
    from hetrain.train.checkpoint import CommitStore, loads
    from leave_commit import COMMIT_AFTER, SETS as SCHEDULE

    out = tmp_path / "state"
    rc, log, _ = launch(str(HERE / "leave_commit.py"), str(out), cluster=small_cluster(3, 0), mode="allreduce",
                        timeout=30, limit=300)
    assert rc == 0, log
    runs = [torch.load(out / f"rank{r}.pt") for r in range(3)]
    source = runs[1]["committed"]  # in every set; the lowest rank of the sets worker 0 is out of
    assert 0 not in SCHEDULE[COMMIT_AFTER]
    for r in (0, 2):  # every worker holds it once the commit is made (brought up to date from rank 1)
        _same(runs[r]["committed"], source, f"rank {r} after the commit")
    for replica in ("w0", "w1"):  # what a restart restores, whichever replica it reads
        seq, data = CommitStore(out / "elastic", replica).newest()
        snap = loads(data)["objects"]
        got = {"model": snap["model"],
               "momentum": [snap["optimizer"]["state"][k]["momentum_buffer"] for k in range(len(source["momentum"]))]}
        _same(got, source, f"commit {seq} of replica {replica}")
    rejoins = [s for s in range(1, len(SCHEDULE)) if 0 in SCHEDULE[s] and 0 not in SCHEDULE[s - 1]]
    assert rejoins == [3, 5]
    for s in rejoins:  # parameters, momentum and batch-norm buffers: the source's
        _same(runs[0]["rejoined"][s], runs[1]["rejoined"][s], f"worker 0 rejoining at step {s}")
    for r in (0, 2):  # (each worker's batch-norm statistics are its own samples' since the last rejoin)
        _same(runs[r]["final"], runs[1]["final"], f"rank {r} at the end", buffers=False, tol=1e-6)
