"""Shares follow speed, respect memory, and the sampler still covers every sample once."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.perf.steptime import BatchDoesNotFitError, balanced_sizes
from hetrain.train.balance import BalanceConfig, memory_caps
from hetrain.train.sampler import GlobalBatchSampler

BIG = 10**9


def test_sizes_follow_speed():
    sizes = balanced_sizes(550, [1.0, 1.0, 0.5, 0.25], [BIG] * 4)
    assert sizes.sum() == 550
    assert list(sizes) == [200, 200, 100, 50]


def test_memory_cap_water_fills_the_rest():
    sizes = balanced_sizes(100, [4.0, 1.0, 1.0], [30, BIG, BIG])
    assert list(sizes) == [30, 35, 35]


def test_batch_that_does_not_fit_says_by_how_much():
    caps = memory_caps([1 * 2**20, 2 * 2**20], BalanceConfig(memory_per_sample=2**16), 64)
    assert list(caps) == [16, 32]
    with pytest.raises(BatchDoesNotFitError, match=r"global batch of 64 samples .* at most 48 samples .*"
                                                   r"w0: 16, w1: 32.* short by 16 samples \(1\.0 MiB\)"):
        balanced_sizes(64, [1, 1], caps, labels=["w0", "w1"], memory_per_sample=2**16)


def test_config_validation():
    with pytest.raises(Exception, match="window"):
        BalanceConfig(window=1)


@settings(max_examples=60, deadline=None)
@given(g=st.integers(4, 300), speeds=st.lists(st.floats(0.01, 10), min_size=1, max_size=6),
       capf=st.lists(st.floats(0.1, 3), min_size=6, max_size=6))
def test_sizes_invariants(g, speeds, capf):
    n = len(speeds)
    caps = np.maximum(1, (np.array(capf[:n]) * g / n).astype(int))
    if caps.sum() < g:
        with pytest.raises(BatchDoesNotFitError):
            balanced_sizes(g, speeds, caps)
        return
    sizes = balanced_sizes(g, speeds, caps)
    assert sizes.sum() == g
    assert np.all(sizes <= caps) and np.all(sizes >= 0)
    if g >= n:
        assert np.all(sizes >= np.minimum(1, caps))
    # deterministic: every worker computes the same answer from the same numbers
    assert np.array_equal(sizes, balanced_sizes(g, list(speeds), caps.copy()))


@settings(max_examples=30, deadline=None)
@given(num=st.integers(10, 200), gb=st.integers(4, 40), n=st.integers(1, 4), seed=st.integers(0, 1000))
def test_every_sample_once_per_epoch_whatever_the_shares(num, gb, n, seed):
    if gb < n:
        return
    sampler = GlobalBatchSampler(num, gb, n, seed=seed)
    rng = np.random.default_rng(seed)
    for epoch in range(2):
        seen = []
        for step in range(sampler.steps_per_epoch()):
            # shares change every step, as the balancer's do
            sizes = balanced_sizes(gb, rng.uniform(0.05, 1, n), [10**6] * n)
            parts = sampler.split(sampler.global_batch_at(epoch, step), sizes)
            if len(sampler.global_batch_at(epoch, step)) == gb:
                assert [len(p) for p in parts] == list(sizes)  # the exact sizes are honoured
            for w in range(n):
                seen += list(parts[w])
        assert sorted(seen) == list(range(num))
