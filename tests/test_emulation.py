"""Emulated links and devices end to end, in a job started by the launcher: what the
rate limiter and the emulated device recorded, and lower bounds on the time they took
(a sleep never ends early, so these hold on a loaded host)."""
import pytest
import torch

from tests.helpers import small_cluster

STEPS, NUMEL = 4, 100_000


@pytest.mark.slow
def test_ratelimited_uplinks_and_device_speeds(launch, tmp_path):
    cluster = small_cluster(workers=2, cpus=1, emulate="ratelimit")
    for m in cluster["machines"]:
        m["bandwidth"] = "16mbit"  # 2 MB/s: 1.6 MB per worker takes >= 0.77 s
    out = tmp_path / "res"
    rc, log, _ = launch("shaped.py", str(out), str(STEPS), str(NUMEL), cluster=cluster, mode="ps")
    assert rc == 0, log
    for r, speed in enumerate([1.0, 0.5]):  # small_cluster's device speeds
        got = torch.load(out / f"rank{r}.pt")
        # mode ps: every partition goes to the CPU machine, so every gradient byte is paced
        assert got["consumed"] == STEPS * NUMEL * 4, got
        assert got["rate"] == pytest.approx(2e6)
        assert got["elapsed"] >= (got["consumed"] - got["burst"]) / got["rate"], got
        # device speed s: the emulated device sleeps (1/s - 1) x the real compute
        assert got["speed"] == speed
        assert got["slept_s"] == pytest.approx(got["real_s"] * (1 / speed - 1), rel=1e-9, abs=1e-12), got
        assert got["wall_s"] >= got["real_s"] / speed, got
