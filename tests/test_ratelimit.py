import pytest

from hetrain.cluster import ratelimit
from hetrain.cluster.ratelimit import SharedTokenBucket


def test_bucket_charges_debt_at_the_link_rate(tmp_path, monkeypatch):
    clock = {"t": 100.0}
    slept = []
    monkeypatch.setattr(ratelimit.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(ratelimit.time, "sleep", lambda s: slept.append(s))
    a = SharedTokenBucket(tmp_path / "m.bucket", rate=1000.0, burst=100.0)
    b = SharedTokenBucket(tmp_path / "m.bucket", rate=1000.0, burst=100.0)  # another process, same machine
    assert a.consume(100) == 0.0  # the burst is free
    assert a.consume(500) == pytest.approx(0.5)  # 500 bytes at 1000 B/s
    assert b.consume(1000) == pytest.approx(1.5)  # shares the debt of the same NIC
    clock["t"] += 1.5  # time passes: the debt is paid
    assert b.consume(0) == pytest.approx(0.0, abs=1e-9)
    clock["t"] += 10  # idle: tokens cap at the burst
    assert a.consume(100) == 0.0 and a.consume(100) == pytest.approx(0.1)
    assert slept == [pytest.approx(x) for x in (0.5, 1.5, 0.1)]
