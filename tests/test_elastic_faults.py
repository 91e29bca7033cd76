"""Machines come and go, for real: processes killed and stopped mid-training are named
on every rank, the launcher restarts the job from its last commit, and the final model
equals an uninterrupted run on the same data order."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from hetrain.train.sampler import GlobalBatchSampler
from tests.helpers import SCRIPTS, repo_env, small_cluster

sys.path.insert(0, str(SCRIPTS))
import elastic_train as et  # noqa: E402

BATCH = 24


def reference(epochs: int) -> dict:
    """One process, the whole global batch per step: what the job must end with."""
    x, y = et.data()
    model = et.make_model()
    opt = et.make_optimizer(model.parameters())
    sampler = GlobalBatchSampler(et.SAMPLES, BATCH, 1, seed=3)
    for e in sampler.epochs(epochs):
        for s in sampler.steps():
            idx = torch.from_numpy(sampler.global_batch_at(e, s))
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.state_dict()


class Job:
    """`hetrain launch` of tests/scripts/elastic_train.py, output collected as it comes."""

    def __init__(self, tmp_path: Path, cluster: dict, *script_args: str, flags: tuple = ()):
        cfile = tmp_path / "cluster.yaml"
        cfile.write_text(yaml.safe_dump(cluster))
        self.run_dir, self.out = tmp_path / "run", tmp_path / "out"
        cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--timeout", "10",
               "--run-dir", str(self.run_dir), *flags, str(SCRIPTS / "elastic_train.py"), "--out", str(self.out),
               "--batch", str(BATCH), *script_args]
        env = repo_env()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def story(self) -> str:
        """The launcher's own lines and the restores: what happened, for failure messages."""
        return "".join(line for line in self.lines if line.startswith("hetrain") or "hetrain.elastic" in line)

    def wait_for(self, pattern: str, limit: float = 150) -> None:
        end = time.monotonic() + limit
        while not re.search(pattern, self.log):
            assert self.proc.poll() is None and time.monotonic() < end, f"never saw {pattern!r}:\n{self.log[-5000:]}"
            time.sleep(0.1)

    def pid(self, rank: int, round_: int) -> int:
        """The process of `rank` in round `round_` of this job."""
        want = [f"HETRAIN_RUN_DIR={self.run_dir}".encode(), f"HETRAIN_RANK={rank}".encode(),
                f"HETRAIN_RESTART={round_}".encode()]
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if all(w in environ for w in want):
                return int(pid)
        raise AssertionError(f"no process for rank {rank} in round {round_}:\n{self.log[-3000:]}")

    def signal(self, rank: int, round_: int, sig: int) -> None:
        os.kill(self.pid(rank, round_), sig)

    def finish(self, limit: float = 240) -> int:
        try:
            self.proc.wait(timeout=limit)  # the hang detector
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(10)
        return self.proc.returncode


def assert_named_everywhere(log: str, round_: int, culprit: str, ranks: range) -> None:
    """The launcher names the stopped process, and so does every other rank of the round."""
    assert f"hetrain: {culprit} stopped answering: its process is stopped" in log, log[-5000:]
    block = log.split(f"round {round_}:", 1)[-1] if round_ else log
    block = block.split(f"round {round_ + 1}:", 1)[0]
    for r in ranks:
        if f"rank {r} " in culprit:
            continue
        assert re.search(rf"\[{r}:[^\]]*\].*PeerLostError: rank {r} .*lost {re.escape(culprit)} .*stopped answering",
                         block), f"rank {r} did not name {culprit}:\n{block[-6000:]}"


def assert_same_model(out: Path, epochs: int) -> None:
    got = torch.load(out / "final.pt", weights_only=True)
    for k, v in reference(epochs).items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6)


def assert_every_sample_once(out: Path, log: str, epochs: int) -> None:
    """Along the committed timeline (each round from where it resumed up to where the
    next one resumed), every global step's batch is covered exactly once."""
    resumed = {int(r): int(c) for r, c in re.findall(r"round (\d+) resumed from commit \d+ \(epoch (\d+)", log)}
    starts = {int(r): int(e) * (et.SAMPLES // BATCH) + int(s)
              for r, e, s in re.findall(r"round (\d+) resumed from commit \d+ \(epoch (\d+), step (\d+)\)", log)}
    assert resumed, log[-3000:]
    rounds = sorted({int(p.name.split("-")[1][1:]) for p in out.glob("seen-r*")})
    starts[rounds[0]] = starts.get(rounds[0], 0)
    sampler = GlobalBatchSampler(et.SAMPLES, BATCH, 1, seed=3)
    per_step: dict[int, list[int]] = {}
    for i, r in enumerate(rounds):
        end = starts.get(rounds[i + 1], 10**9) if i + 1 < len(rounds) else 10**9
        for f in out.glob(f"seen-r{r}-*.txt"):
            for line in f.read_text().splitlines():
                g, idx = line.split(" ", 1) if " " in line else (line, "")
                if starts[r] <= int(g) < end:
                    per_step.setdefault(int(g), []).extend(int(i) for i in idx.split(",") if i)
    spe = sampler.steps_per_epoch()
    assert sorted(per_step) == list(range(epochs * spe))
    for g, idx in per_step.items():
        assert sorted(idx) == sorted(sampler.global_batch_at(g // spe, g % spe).tolist()), g


@pytest.mark.slow
def test_killed_and_stopped_processes_are_named_and_the_job_recovers(tmp_path):
    """Round 0: worker w1 kills itself mid-epoch. Round 1: the summation server is
    killed mid-step. Round 2: worker w1 is stopped (SIGSTOP). Round 3: the server is
    stopped. Each is named by the launcher (and a stopped one by every other rank), the
    job restarts from its last commit each time and ends as an uninterrupted run."""
    job = Job(tmp_path, small_cluster(workers=2, cpus=1), "--kill-machine", "w1", "--kill-rounds", "0",
              "--kill-step", "7", "--epochs", "4", flags=("--mode", "ps", "--max-restarts", "4"))
    try:
        job.wait_for(r"step 9 round 1 ")
        job.signal(2, 1, signal.SIGKILL)  # rank 2: the server on c0
        job.wait_for(r"step \d+ round 2 ")
        job.signal(1, 2, signal.SIGSTOP)  # worker w1
        job.wait_for(r"step \d+ round 3 ")
        job.signal(2, 3, signal.SIGSTOP)
    finally:
        rc = job.finish()
    log = job.log
    assert rc == 0, job.story + log[-4000:]
    assert "rank 1 (worker on machine w1) failed (killed by SIGKILL)" in log, job.story
    assert "rank 2 (server on machine c0) failed (killed by SIGKILL)" in log, job.story
    assert_named_everywhere(log, 2, "rank 1 (worker on machine w1)", range(3))
    assert_named_everywhere(log, 3, "rank 2 (server on machine c0)", range(3))
    assert "round 4: mode ps, 2 workers + 1 summation servers on w0, w1, c0" in log, job.story
    assert_every_sample_once(job.out, log, 4)
    assert_same_model(job.out, 4)


@pytest.mark.slow
def test_fewer_workers_rebalance_and_a_machine_comes_back(tmp_path):
    """w1 fails in rounds 0 and 1, so round 2 runs on the two other workers (shares of
    the global batch re-balanced over 2; the server split is rebuilt from the reduced
    cluster, see test_elastic.py for the BytePS figures); after its cool-down
    w1 is healthy again and joins at a commit; the model still ends as uninterrupted."""
    job = Job(tmp_path, small_cluster(workers=3, cpus=1), "--kill-machine", "w1", "--kill-rounds", "0,1",
              "--kill-step", "7", "--epochs", "4", flags=("--mode", "ps", "--max-restarts", "3", "--rejoin-after", "3"))
    rc = job.finish()
    log = job.log
    assert rc == 0, log[-6000:]
    assert "machine w1 caused 2 failures in a row" in log, job.story
    assert "round 2: mode ps, 2 workers + 1 summation servers on w0, w2, c0" in log, job.story
    shares = [eval(s) for s in re.findall(r"step \d+ round 2 shares (\[[\d, ]+\])", log)]
    assert shares and all(len(s) == 2 and sum(s) == BATCH for s in shares), log[-4000:]
    assert "w1 can join; asking the workers to stop at their next commit" in log
    assert "round 3: mode ps, 3 workers + 1 summation servers on w0, w1, w2, c0" in log, job.story
    assert re.search(r"step \d+ round 3 shares \[\d+, \d+, \d+\]", log)
    assert_every_sample_once(job.out, log, 4)
    assert_same_model(job.out, 4)
