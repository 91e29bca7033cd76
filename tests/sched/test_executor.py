"""Real processes on gloo: a job stopped by signal and resumed at another world size
ends with exactly the parameters of an uninterrupted run on the same sample order."""
import signal
import time
from pathlib import Path

import pytest
import torch

from hetrain.sched.executor import compare, launch_job
from hetrain.sched.job import RealJobSpec
from hetrain.sched.job import Alloc
from hetrain.train.elastic import load_committed
from hetrain.sched.worker import EXIT_STOPPED, global_batch
from hetrain.sched.worker import main as worker_main

STEPS = 16


def _launch(job_dir: Path, world: int, compute_s: float = 0.0):
    """One job through hetrain's launcher (a list, to keep the waiting code uniform)."""
    return [launch_job(job_dir, world, ["--steps", str(STEPS), "--seed", "7", "--compute-s", str(compute_s)],
                       quiet=False)]


def _committed(job_dir: Path) -> dict:
    """The job's last commit, flattened: step, done and the model's state_dict."""
    c = load_committed(job_dir / "elastic")
    return {**c["values"], "model": c["objects"]["model"]}


def _wait(procs, timeout=120):
    outs = [p.communicate(timeout=timeout)[0].decode()[-1500:] for p in procs]
    return [p.returncode for p in procs], outs


def test_sample_order_does_not_depend_on_world_size():
    b = global_batch(5, 32, 512, 7)
    assert len(set(b.tolist())) == 32
    halves = torch.cat([b[0::2], b[1::2]])
    assert sorted(halves.tolist()) == sorted(b.tolist())
    assert torch.equal(global_batch(5, 32, 512, 7), b)


@pytest.mark.slow
def test_stopped_and_resumed_job_matches_uninterrupted_run(tmp_path):
    ref_dir, el_dir = tmp_path / "ref", tmp_path / "elastic"
    ref_dir.mkdir(), el_dir.mkdir()
    # elastic: 2 ranks, stopped by signal mid-run, resumed on 1 rank
    el = _launch(el_dir, 2, compute_s=0.2)
    deadline = time.time() + 120
    while not (el_dir / "progress").exists() or int((el_dir / "progress").read_text().split()[0]) < 3:
        assert time.time() < deadline and all(p.poll() is None for p in el), "elastic job did not start"
        time.sleep(0.05)
    for p in el:
        p.send_signal(signal.SIGUSR1)
    codes, errs = _wait(el)
    assert codes == [EXIT_STOPPED], errs  # the launcher reports the clean stop of both ranks
    mid = _committed(el_dir)
    assert 3 <= mid["step"] < STEPS and not mid["done"]
    codes, errs = _wait(_launch(el_dir, 1))
    assert codes == [0], errs
    # the uninterrupted reference: one rank, run in this process (no extra cold start)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        assert worker_main(["--job-dir", str(ref_dir), "--steps", str(STEPS), "--seed", "7"]) == 0
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)
    a, b = _committed(ref_dir), _committed(el_dir)
    assert a["done"] and b["done"] and a["step"] == b["step"] == STEPS
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-5, atol=1e-6)
    # and training did move the parameters
    assert not torch.allclose(a["model"]["0.weight"], mid["model"]["0.weight"])


SEEN_RESTARTS: list[int] = []  # each job's restart count as the test policy was shown it


def grow_once_running(jobs, cluster, allocation, now):
    """One GPU per job until it has made progress, then two: every job is resized once while
    running, decided at a round boundary whatever the host's speed (test policy)."""
    SEEN_RESTARTS.extend(j.restarts for j in jobs)
    return {j.job_id: Alloc(0, 2 if j.remaining < j.work else 1) for j in jobs}


grow_once_running.round_s = 1.0


@pytest.mark.slow
def test_executor_runs_workload_and_measures_restarts(tmp_path):
    SEEN_RESTARTS.clear()
    specs = [RealJobSpec("a", 0.0, 12, 0.3, seed=1)]
    log = []
    out = compare("cpu:2", grow_once_running, tmp_path, specs=specs, log=log.append)
    real = out["real"]
    assert set(real["jct_s"]) == {"a"} and real["jct_s"]["a"] > 0
    assert real["restarts"] == 1 and len(real["restart_costs_s"]) == 1 and real["restart_costs_s"][0] > 0, log
    # the policy is shown the restart too (Sia's restart penalty reads Job.restarts)
    assert SEEN_RESTARTS[0] == 0 and max(SEEN_RESTARTS) == 1
    assert any("job a: 1 cpu -> 2 cpu (stop/restart)" in line for line in log), log
    # the policy planned on curves fitted to what the workers reported at both sizes
    assert {r["gpus"] for r in real["step_times"]} == {1, 2}
    assert all(r["measured_s"] > 0 and r["fitted_s"] > 0 and r["steps"] > 0 for r in real["step_times"])
    assert {"compute:cpu", "bandwidth"} <= set(real["fits"]["a"]["measured"])
    assert out["sim_s"] > 0 and out["restart_s"] == pytest.approx(real["restart_costs_s"][0])
    ck = _committed(tmp_path / "a")
    assert ck["done"] and ck["step"] == 12


def test_sample_stream_does_not_depend_on_the_batches():
    from hetrain.sched.worker import stream_batch

    whole = stream_batch(0, 100, 40, 3)  # crosses two epoch boundaries
    parts = torch.cat([stream_batch(0, 8, 40, 3), stream_batch(8, 8, 40, 3), stream_batch(16, 84, 40, 3)])
    assert torch.equal(whole, parts)
    assert sorted(whole[:40].tolist()) == list(range(40))  # one epoch: every sample once
    assert torch.equal(stream_batch(32, 32, 512, 7), global_batch(1, 32, 512, 7))


def _reference(schedule, lr=0.05, base=8, seed=7):
    """One process, no hetrain: `schedule` = [(batch, steps)] from the start of the stream."""
    from hetrain.perf.goodput import scale_lr
    from hetrain.sched.worker import build, stream_batch

    x, y, model = build(seed, 512, 16)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    pos = 0
    for batch, steps in schedule:
        for g in opt.param_groups:
            g["lr"] = scale_lr(lr, base, batch)
        for _ in range(steps):
            idx = stream_batch(pos, batch, 512, seed)
            opt.zero_grad(set_to_none=False)
            (((model(x[idx]) - y[idx]) ** 2).sum() / batch).backward()
            opt.step()
            pos += batch
    return model.state_dict(), pos


@pytest.mark.slow
def test_batch_change_on_restart_resumes_with_the_same_samples(tmp_path):
    """Stopped at batch 8, restarted at batch 16 (learning rate x sqrt 2): the job goes on
    from the samples it had seen and ends with the parameters of a one-process run that
    switches batch at the same step."""
    args = ["--steps", str(STEPS), "--seed", "7", "--base-batch", "8"]
    first = launch_job(tmp_path, 1, args + ["--batch", "8", "--compute-s", "0.2"], quiet=False)
    deadline = time.time() + 120
    while not (tmp_path / "progress").exists() or int((tmp_path / "progress").read_text().split()[0]) < 3:
        assert time.time() < deadline and first.poll() is None, "job did not start"
        time.sleep(0.05)
    first.send_signal(signal.SIGUSR1)
    codes, errs = _wait([first])
    assert codes == [EXIT_STOPPED], errs
    k = _committed(tmp_path)["step"]
    assert _committed(tmp_path)["samples"] == 8 * k
    codes, errs = _wait([launch_job(tmp_path, 1, args + ["--batch", "16"], quiet=False)])
    assert codes == [0], errs
    end = _committed(tmp_path)
    m = -(-(STEPS - k) // 2)  # a batch-16 step is 2 base steps of work (noise scale unknown: efficiency 1)
    want, pos = _reference([(8, k), (16, m)])
    assert end["done"] and end["samples"] == pos == 8 * k + 16 * m and end["step"] == k + m
    assert end["progress"] == pytest.approx(k + 2 * m)
    for name in want:
        torch.testing.assert_close(end["model"][name], want[name], rtol=1e-5, atol=1e-6)
