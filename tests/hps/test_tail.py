"""The dynamic tail: the end of every step claimed while it runs. The split is pure; the
claims run on two thread-workers over a real torch.distributed store (HashStore)."""
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hetrain.errors import UserError
from hetrain.train.balance import BalanceConfig
from hetrain.train.loader import BalancedBatchSampler, BalancedLoader, WorkerGroup
from hetrain.train.tail import TailClaims, split_tail
from tests.hps.test_loader import ThreadGroup, run_workers


def test_split_holds_back_a_fraction_and_sizes_chunks_by_speed():
    s = split_tail([300, 150], 0.2, chunks_per_worker=3)
    assert s.static.tolist() == [240, 120] and s.start == 360 and s.total == 450 and s.held == 90
    assert s.chunk.tolist() == [20, 10]  # a third of what each held back: chunks take either worker as long
    # a worker keeps one sample up front (its batch size weights its gradient); no share: no claims
    one = split_tail([1, 0, 9], 0.5)
    assert one.static.tolist() == [1, 0, 5] and one.chunk.tolist() == [1, 0, 2]
    # accumulating: whole micro-batches held back and claimed, a short remainder stays up front
    acc = split_tail([40, 19], 0.3, micro=4)
    assert acc.static.tolist() == [28, 15] and acc.chunk.tolist() == [4, 4]
    # one worker, or nothing to hold back: no tail
    assert split_tail([64, 0], 0.3).held == 0 and split_tail([1, 1], 0.3).held == 0
    with pytest.raises(UserError, match="tail must be"):
        split_tail([4, 4], 1.0)
    with pytest.raises(UserError, match="tail must be"):
        BalanceConfig(tail=-0.1)


def test_claims_take_each_sample_once_and_old_keys_go():
    store = dist.HashStore()
    a, b = TailClaims(store, 0, lag=2), TailClaims(store, 1, lag=2)
    assert a.key == b.key  # the first loader of each rank claims from the same keys
    for step in range(4):
        split = split_tail([30, 20], 0.4)
        a.begin(split)
        b.begin(split)
        got = []
        order = [a, a, b, a, b, b, a, b][step:] + [a, b] * 8  # interleaved in a different order every step
        for who in order:
            c = who.claim()
            if c is not None:
                got.append(c)
        assert a.done and b.done
        covered = sorted(i for lo, hi in got for i in range(lo, hi))
        assert covered == list(range(split.start, split.total))
        assert a.claimed + b.claimed == split.held
        a.end()
        b.end()
    # worker 0 deletes a step's key `lag` steps later: the store keeps a bounded number
    assert store.num_keys() == 2


class _CountingStore:
    """A HashStore that counts its `add` calls (each is a round trip to the launcher's store)."""

    def __init__(self):
        self.inner, self.adds = dist.HashStore(), 0

    def add(self, key, amount):
        self.adds += 1
        return self.inner.add(key, amount)

    def delete_key(self, key):
        return self.inner.delete_key(key)


def test_the_claim_that_takes_the_last_sample_is_the_last():
    store = _CountingStore()
    a, b = TailClaims(store, 0), TailClaims(store, 1)
    split = split_tail([30, 20], 0.4)  # samples 30..49 held back; a claims 4 at a time, b 3
    a.begin(split)
    b.begin(split)
    got = [a.claim() for _ in range(6)]  # a alone takes the whole tail in 5 chunks
    assert got == [(30, 34), (34, 38), (38, 42), (42, 46), (46, 50), None]
    assert a.done and a.claimed == 20 and store.adds == 5  # no claim after the one that reached the end
    assert b.claim() is None and b.done and store.adds == 6  # b learns it with its own claim
    a.end()
    b.end()


def test_stopping_early_is_an_error():
    c = TailClaims(dist.HashStore(), 0)
    c.begin(split_tail([30, 20], 0.4))
    c.claim()
    with pytest.raises(UserError, match="micro_batches"):
        c.end()


class _PassCounter:
    """What the loader asks of an optimizer here: the backward passes of the step (the
    exchange starts on the last one's hooks)."""

    backward_passes_per_step = 1


def test_a_late_worker_claims_nothing_and_every_sample_trains_once():
    """Two thread-workers; in every step worker 1 starts its passes only once worker 0 has
    finished all of its own (an event, not a timing guess): worker 0 claims the whole
    tail and worker 1 trains its up-front share alone. Every sample of the epoch is
    trained on exactly once, and before every pass the optimizer knows whether it is the
    last (the next chunk is claimed a pass ahead)."""
    store = dist.HashStore()
    data = torch.arange(200)
    finished = [threading.Event() for _ in range(5)]  # worker 0 is through step s

    def make(group):
        g = WorkerGroup(group.rank, group.size, group.gather, group.labels, store)
        return BalancedLoader(torch.utils.data.TensorDataset(data), 40, device="cpu", group=g, seed=1,
                              balance="equal", tail=0.5, optimizer=_PassCounter())

    def body(rank, loader):
        seen, passes, told = [], [], []
        opt = loader.batches.optimizer
        for step, (x,) in enumerate(loader):
            if rank == 1:
                assert finished[step].wait(timeout=30), "worker 0 never finished its step"
            n, step_told = 0, []
            for mx in loader.micro_batches(x):
                step_told.append(opt.backward_passes_per_step)
                seen += mx.tolist()
                n += 1
            if rank == 0:
                finished[step].set()
            passes.append(n)
            told.append(step_told)
        loader.finish()
        return seen, passes, told

    res = run_workers(2, make, body)
    assert sorted(res[0][0] + res[1][0]) == list(range(200))
    # equal shares of 20, 10 of each held back: worker 0 takes all 20 in chunks of 4 (a
    # third of what it held back, rounded up), worker 1's first claim finds the tail used up
    assert res[0][1] == [6] * 5 and len(res[0][0]) == 150
    assert res[1][1] == [1] * 5 and len(res[1][0]) == 50
    for _seen, passes, told in res:
        for n, step_told in zip(passes, told):  # "at least one more" before each pass, the count before the last
            assert step_told == [k + 2 for k in range(n - 1)] + [n], (n, step_told)


def test_tail_needs_the_micro_batches_loop_and_a_store():
    with pytest.raises(UserError, match="needs a store"):
        BalancedBatchSampler(40, 8, group=ThreadGroup(2).group(0), tail=0.3)
    store = dist.HashStore()

    def make(group):
        return BalancedBatchSampler(40, 8, group=WorkerGroup(group.rank, group.size, group.gather, (), store),
                                    tail=0.3, balance="equal")

    with pytest.raises(UserError, match="DataLoader"):
        run_workers(2, make, lambda rank, s: list(s))

    def plain(rank, loader):  # the loop without micro_batches leaves the tail unclaimed
        for _x in loader:
            pass

    with pytest.raises(UserError, match="micro_batches"):
        run_workers(2, lambda g: BalancedLoader(torch.utils.data.TensorDataset(torch.arange(40)), 8, device="cpu",
                                                group=WorkerGroup(g.rank, g.size, g.gather, (), dist.HashStore()),
                                                tail=0.3, balance="equal"), plain)


def test_one_worker_has_no_tail():
    loader = BalancedLoader(torch.utils.data.TensorDataset(torch.arange(16)), 8, device="cpu",
                            group=ThreadGroup(1).group(0), tail=0.3)
    got = [[len(m) for m in loader.micro_batches(x)] for (x,) in loader]
    assert got == [[8], [8]] and np.all(loader.sizes == 8)


def test_a_store_that_stopped_answering_is_named():
    class Gone:
        def add(self, key, amount):
            raise RuntimeError("Broken pipe")

        def delete_key(self, key):
            return False

    c = TailClaims(Gone(), 0)
    c.begin(split_tail([10, 10], 0.3))
    with pytest.raises(RuntimeError, match="job's store failed \\(Broken pipe\\); the launcher"):
        c.claim()
