"""A step's time on its device without draining it (hetrain.train.stepclock): on a CUDA
device the balanced sampler reads each step's time from events, one step late where the
device has not finished it, and never synchronises the device to time a step; and a job
where one worker trains alone (`FitExchange.solo`) exchanges the balancer's rows for the
metrics only, every worker deciding the same on the same steps, with one process's result."""
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hetrain.train.balance import BalanceConfig
from hetrain.train.balance_exchange import SOLO_EVERY
from hetrain.train.balanced_sampler import BalancedBatchSampler, WorkerGroup
from hetrain.train.stepclock import StepClock
from tests.cudastandin import standin
from tests.helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from reference import GLOBAL_BATCH, single_process  # noqa: E402

HERE = Path(__file__).parent / "scripts"
sys.path.insert(0, str(HERE))
from solo_loop import EPOCHS  # noqa: E402
DELAYS = [0.002, 0.02, 0.002, 0.02, 0.002, 0.02]  # seconds each step takes (at least)


@pytest.fixture
def cuda_standin():
    chk = standin.install(1)
    try:
        yield chk
    finally:
        races = standin.uninstall()
    assert races == [], "\n".join(races)


def _alone(device: torch.device) -> BalancedBatchSampler:
    """A sampler of one worker (its own gather), 6 steps of 8 samples, on `device`."""
    group = WorkerGroup(0, 1, lambda row: (lambda: np.asarray(row, dtype=np.float64)[None, :]))
    return BalancedBatchSampler(48, 8, device=device, group=group, config=BalanceConfig(window=4, recent=3))


def _run(sampler: BalancedBatchSampler) -> tuple[list, list]:
    """Iterate the sampler (each step sleeping its DELAYS); what was recorded, and how many
    steps were recorded when each step began."""
    recorded, seen = [], []
    record = sampler.balancer.record
    sampler.balancer.record = lambda s, t: (recorded.append((s, t)), record(s, t))
    for k, idx in enumerate(sampler):
        seen.append(len(recorded))
        time.sleep(DELAYS[k])
    sampler.finish()
    return recorded, seen


def test_a_cuda_step_is_timed_by_events_one_step_late_without_synchronising(cuda_standin, monkeypatch):
    def no_sync(*_a, **_k):
        raise AssertionError("the step was timed by draining the device (torch.cuda.synchronize)")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    sampler = _alone(torch.device("cuda", 0))
    assert sampler.clock.on_device
    recorded, seen = _run(sampler)
    # the stand-in's events are "still running" at their first query: each step is read at
    # the next step's end (waiting on that event alone), the last one at finish()
    assert seen == [0, 0, 1, 2, 3, 4]
    assert len(recorded) == 6
    assert [s for s, _ in recorded] == [8] * 6
    # the device time between the step's marks: at least what the step took, step by step
    assert all(t >= d for (_, t), d in zip(recorded, DELAYS)), (recorded, DELAYS)
    assert recorded[1][1] > recorded[0][1] and recorded[3][1] > recorded[2][1]
    # the metrics rows carry the step before's samples and time (every=2: steps 2, 4, 6 exchange)
    assert sampler.last_rows is not None and sampler.last_rows[0, 0] == 8
    assert sampler.last_rows[0, 1] == recorded[4][1]


def test_a_cpu_step_is_recorded_at_its_end():
    recorded, seen = _run(_alone(torch.device("cpu")))
    assert seen == [0, 1, 2, 3, 4, 5]
    assert all(t >= d for (_, t), d in zip(recorded, DELAYS)), (recorded, DELAYS)


def test_event_time_needs_the_end_completed(cuda_standin):
    """The clock reads an event's time only once the event is known complete (query or
    synchronize), as CUDA requires (the stand-in refuses otherwise)."""
    clock = StepClock(torch.device("cuda", 0))
    a = clock.mark()
    time.sleep(0.003)
    b = clock.mark()
    assert clock.seconds(a, b, wait=False) is None  # first query: still running
    with pytest.raises(RuntimeError, match="not ready"):
        clock.mark().elapsed_time(clock.mark())
    assert clock.seconds(a, b, wait=True) >= 0.003


def _check_solo(out: Path, workers: int = 3) -> None:
    runs = [torch.load(out / f"rank{r}.pt") for r in range(workers)]
    steps = len(runs[0]["seen"])
    assert steps == 9 * EPOCHS
    for r, got in enumerate(runs):
        # every worker: the same agreed decisions on the same steps
        assert got["solo"] and got["every"] == runs[0]["every"] >= SOLO_EVERY
        for key in ("history", "posts", "applied"):
            assert got[key] == runs[0][key], (r, key)
        assert got["posts"] == list(range(got["every"], steps + 1, got["every"])), got["posts"]
        assert len(got["posts"]) == 2
        assert got["applied"], "the metrics rows were applied"
        assert got["syncs"] == [], f"rank {r} synchronised the device while training at steps {got['syncs']}"
    assert all(h == [GLOBAL_BATCH, 0, 0] or sum(h) < GLOBAL_BATCH for h in runs[0]["history"])
    assert [len(b) for b in runs[0]["seen"]] == ([GLOBAL_BATCH] * 8 + [8]) * EPOCHS
    assert all(b == [] for got in runs[1:] for b in got["seen"])
    assert [s for s, _ in runs[0]["recorded"]] == [len(b) for b in runs[0]["seen"]]
    assert (runs[0]["exchanges"], runs[1]["sat_out"], runs[2]["sat_out"]) == (steps, steps, steps)
    ref = single_process(runs[0]["seen"])
    for r, got in enumerate(runs):  # the trainer's, and the others' brought up to date at the end
        for name, want in ref.items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-6, atol=1e-7, msg=f"rank {r} {name}")


@pytest.mark.slow
def test_a_worker_alone_exchanges_metrics_only_and_every_worker_agrees(launch, tmp_path):
    out = tmp_path / "out"
    cluster = {"name": "solo", "machines": [{"name": f"w{i}", "role": "worker", "device": {"speed": 1.0}}
                                            for i in range(3)]}
    rc, log, _ = launch(str(HERE / "solo_loop.py"), str(out), cluster=cluster, mode="allreduce", timeout=90,
                        limit=400)
    assert rc == 0, log
    _check_solo(out)


@pytest.mark.slow
def test_a_gpu_worker_alone_under_the_cuda_standin(tmp_path):
    """The same with the trainer on the CUDA stand-in (tests/cudastandin): its steps timed by
    events, no stream race, no device synchronisation while training."""
    import subprocess

    import yaml

    from tests.helpers import ROOT
    from tests.test_cuda_standin import standin_env

    cluster = {"name": "solo-gpu", "machines": [{"name": "g0", "role": "worker", "device": {"cuda": True}}] + [
        {"name": f"w{i}", "role": "worker", "device": {"speed": 1.0}} for i in (1, 2)]}
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "allreduce",
           "--timeout", "60", "--run-dir", str(tmp_path / "run"), str(HERE / "solo_loop.py"), str(out), "--cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=standin_env(1), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "CUDA stream race" not in proc.stdout + proc.stderr
    assert torch.load(out / "rank0.pt")["device"] == "cuda:0"
    _check_solo(out)


@pytest.mark.parametrize("caps, solo", [([24, 0, 0], True), ([0, 0, 24], True), ([24, 1, 0], False), (None, False),
                                        ([24], True)])
def test_solo_only_where_one_worker_can_take_every_sample(caps, solo):
    """`solo` from the agreed caps alone: one worker may take samples and holds the batch;
    then the exchange is for the metrics only (rarer), and a received fit is not solved for."""
    from hetrain.train.balance import Balancer
    from hetrain.train.exchange import InProcessExchange

    cfg = BalanceConfig(window=4, recent=3)
    n = len(caps or [0] * 3)
    bal = Balancer(None, 24, cfg, caps=caps, gather=InProcessExchange(n).gather_for(0), num_workers=n)
    assert bal.solo is solo
    # a collective saved where there are workers to save it with (one worker's is local)
    assert bal.exchange_every == (max(cfg.every, cfg.window, SOLO_EVERY) if solo and n > 1 else cfg.every)
    if solo:
        plan = bal.plan
        bal._apply(np.array([[0.001, 1e-4] + [0.0] * 9, [0.5, 0.1] + [0.0] * 9, [0.5, 0.1] + [0.0] * 9][:n]), 1)
        assert bal.plan is plan and bal.sizes.tolist() == [c and 24 for c in caps]
        assert bal.step_plan() is plan


@pytest.mark.slow
def test_a_worker_alone_by_speed_exchanges_every_window_and_every_worker_agrees(launch, tmp_path):
    """No caps: two workers 25x slower than the third sit out by speed (probed every 12
    steps). While one worker trains alone the balancer's exchange runs every `window`
    steps instead of every `every`, decided from the step's agreed split, so every worker
    posts the same exchanges at the same steps; the result is one process's."""
    out = tmp_path / "out"
    cluster = {"name": "by-speed", "machines": [{"name": "w0", "role": "worker", "device": {"speed": 1.0}}] + [
        {"name": f"w{i}", "role": "worker", "device": {"speed": 0.04}} for i in (1, 2)]}
    rc, log, _ = launch(str(HERE / "solo_loop.py"), str(out), "--by-speed", cluster=cluster, mode="allreduce",
                        timeout=90, limit=400)
    assert rc == 0, log
    runs = [torch.load(out / f"rank{r}.pt") for r in range(3)]
    alone, every, window = runs[0]["alone"], runs[0]["cfg_every"], runs[0]["window"]
    assert not runs[0]["solo"] and every < window
    for r, got in enumerate(runs):
        for key in ("history", "posts", "applied", "alone"):
            assert got[key] == runs[0][key], (r, key)
    steps = len(alone)
    assert sum(alone) >= steps // 2, alone  # out by speed ...
    assert any(any(got["copies"]) for got in runs[1:]), alone  # ... and probed (on copies, out of the exchange)
    # an exchange after a step one worker trained alone only every `window` steps
    assert all(g % (window if alone[g - 1] else every) == 0 for g in runs[0]["posts"]), (runs[0]["posts"], alone)
    assert len(runs[0]["posts"]) < steps // every
    # each step's global batch, split among the workers with samples: one process's result
    batches = [sum((got["seen"][k] for got in runs), []) for k in range(steps)]
    assert [len(b) for b in batches] == ([GLOBAL_BATCH] * 8 + [8]) * (EPOCHS // 3)
    ref = single_process(batches)
    for r, got in enumerate(runs):
        for name, want in ref.items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
