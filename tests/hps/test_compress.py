"""Codecs round-trip within their stated error; error feedback keeps the running sum."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.comm.compress import CODECS, ErrorFeedback, auto_codec, codec_for, get, parse_rules
from hetrain.comm.layout import Manifest
from hetrain.comm.partition import plan_partitions
from hetrain.comm.wire import decode_part, encode_part, wire_plan
from hetrain.errors import UserError


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(CODECS), n=st.integers(1, 1500), scale=st.floats(1e-4, 1e3), seed=st.integers(0, 99))
def test_round_trip_within_stated_error(name, n, scale, seed):
    codec = get(name)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    buf = torch.zeros(codec.nbytes(n), dtype=torch.uint8)
    codec.encode(x, buf)
    y = torch.empty(n)
    codec.decode(buf, y)
    assert torch.all((y - x).abs() <= codec.max_error(x)), (y - x).abs().max()


def test_zeros_and_fp16_overflow():
    for name in CODECS:
        c = get(name)
        y = torch.ones(300)
        buf = torch.zeros(c.nbytes(300), dtype=torch.uint8)
        c.encode(torch.zeros(300), buf)
        c.decode(buf, y)
        assert torch.all(y == 0), name
    c = get("fp16")
    x = torch.tensor([1e6, -1e6, 1.0])
    buf = torch.zeros(c.nbytes(3), dtype=torch.uint8)
    c.encode(x, buf)
    y = torch.empty(3)
    c.decode(buf, y)
    assert torch.isfinite(y).all() and torch.all((y - x).abs() <= c.max_error(x))


def test_payload_sizes():
    n = 100_000
    assert get("fp32").nbytes(n) == 4 * n
    assert get("fp16").nbytes(n) == 2 * n
    assert get("int8").nbytes(n) <= 0.27 * 4 * n
    assert get("int4").nbytes(n) <= 0.14 * 4 * n


@pytest.mark.parametrize("name", ["fp16", "int8", "int4"])
def test_error_feedback_keeps_running_sum(name):
    codec = get(name)
    n = 1000
    ef = ErrorFeedback(n)
    sent = torch.zeros(n, dtype=torch.float64)
    arrived = torch.zeros(n, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    one_step = 0.0
    for _ in range(200):
        x = torch.randn(n, generator=g) * 0.01 + 0.001  # small biased gradients: plain rounding would drift
        buf = torch.zeros(codec.nbytes(n), dtype=torch.uint8)
        ef.encode(codec, x, buf)
        y = torch.empty(n)
        codec.decode(buf, y)
        sent += x.double()
        arrived += y.double()
        one_step = max(one_step, float(codec.max_error(x + ef.residual).max()))
    # Σ arrived = Σ sent − residual (exactly, up to float rounding) and the residual stays within one step's error
    torch.testing.assert_close(arrived + ef.residual.double(), sent, rtol=0, atol=1e-4)
    assert float(ef.residual.abs().max()) <= 2 * one_step + 1e-6


def _enc(codec, x):
    buf = torch.zeros(codec.nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, buf)
    return buf


def test_auto_and_rules():
    assert auto_codec(100, 1e6) == "fp32"  # small tensors stay fp32
    assert auto_codec(1_000_000, 100e9 / 8) == "fp32"
    assert auto_codec(1_000_000, 10e9 / 8) == "fp16"
    assert auto_codec(1_000_000, 2e9 / 8) == "int8"
    assert auto_codec(1_000_000, 400e6 / 8) == "int4"
    rules = parse_rules(["*.bias=fp32", "fc*=int4"])
    assert codec_for("fc1.bias", 10**6, "int8", rules, 1e9) == "fp32"
    assert codec_for("fc1.weight", 10**6, "int8", rules, 1e9) == "int4"
    assert codec_for("conv.weight", 10**6, "auto", rules, 1e12) == "fp32"
    with pytest.raises(UserError, match="NAME_GLOB=CODEC"):
        parse_rules(["bias:fp32"])


def test_wire_plan_covers_every_element_with_its_tensors_codec():
    m = Manifest.of([("a", torch.zeros(300)), ("b", torch.zeros(7)), ("c", torch.zeros(40, 20))])
    parts = plan_partitions(m.numel, [1.0, 2.0], 100)
    plan = wire_plan(parts, m, ["int8", "fp32", "int4"])
    covered = []
    for w in plan:
        covered += [(s.start, s.length, s.codec.name) for s in w.segments]
        assert w.nbytes == sum(s.codec.nbytes(s.length) for s in w.segments)
    pos = 0
    for start, length, name in covered:
        assert start == pos
        want = "int8" if start < 300 else "fp32" if start < 307 else "int4"
        assert name == want
        pos += length
    assert pos == m.numel
    x = torch.randn(m.numel)
    payload = torch.zeros(sum(w.nbytes for w in plan), dtype=torch.uint8)
    ef = ErrorFeedback(m.numel)
    for w in plan:
        encode_part(w, x, payload[w.offset: w.offset + w.nbytes], ef)
    y = torch.empty(m.numel)
    for w in plan:
        decode_part(w, payload[w.offset: w.offset + w.nbytes], y)
    torch.testing.assert_close(y + ef.residual, x)
    torch.testing.assert_close(y[300:307], x[300:307], rtol=0, atol=0)  # the fp32 tensor is exact
    assert wire_plan(parts, m, ["fp32"] * 3) is None
