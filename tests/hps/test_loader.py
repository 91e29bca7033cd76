"""BalancedLoader: every sample of an epoch once, on one worker, whatever the shares; the
shares follow measured speed; the sampler form yields the same indices. Workers are
threads here (a barrier-backed all-gather); the launcher test is in
test_hps_multiprocess.py."""
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.train.balance import BalanceConfig
from hetrain.train.loader import BalancedBatchSampler, BalancedLoader, WorkerGroup
from hetrain.train.metrics import ROW


class ThreadGroup:
    """n threads standing in for n workers: gather = all-gather of one float64 row."""

    def __init__(self, n: int):
        self.n = n
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def group(self, rank: int) -> WorkerGroup:
        def gather(row):
            self.slots[rank] = np.asarray(row, dtype=np.float64)
            self.barrier.wait()
            out = np.stack(self.slots)
            self.barrier.wait()
            return lambda: out
        return WorkerGroup(rank, self.n, gather, tuple(f"w{i}" for i in range(self.n)))


def run_workers(n, make, body):
    """Run body(rank, loader) on n threads; re-raise the first failure."""
    tg = ThreadGroup(n)
    out, errors = [None] * n, []

    def work(rank):
        try:
            out[rank] = body(rank, make(tg.group(rank)))
        except BaseException as err:  # noqa: BLE001 - surfaced below
            errors.append(err)
            tg.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


@settings(max_examples=12, deadline=None)
@given(num=st.integers(5, 90), gb=st.integers(3, 24), n=st.integers(1, 3), seed=st.integers(0, 99),
       drop_last=st.booleans())
def test_each_sample_once_per_epoch_under_changing_shares(num, gb, n, seed, drop_last):
    if gb < n or (drop_last and num < gb):
        return
    data = torch.arange(num)
    delays = np.random.default_rng(seed).uniform(0, 2e-3, size=(n, 200))  # uneven, changing speeds

    def make(group):
        return BalancedLoader(torch.utils.data.TensorDataset(data), gb, device="cpu", group=group, seed=seed,
                              drop_last=drop_last, config=BalanceConfig(window=4, recent=1))

    def body(rank, loader):
        epochs = []
        for _epoch in range(2):
            got, k = [], 0
            for (x,) in loader:
                time.sleep(delays[rank, k % 200] * len(x))  # this worker's "compute"
                got.append(x.tolist())
                k += 1
            epochs.append(got)
        return epochs, [h.tolist() for h in loader.balancer.history]

    res = run_workers(n, make, body)
    steps = num // gb if drop_last else -(-num // gb)
    for e in range(2):
        per_step = [[res[r][0][e][s] for r in range(n)] for s in range(steps)]
        seen = sorted(i for step in per_step for part in step for i in part)
        if drop_last:
            assert len(seen) == steps * gb and len(set(seen)) == len(seen)
        else:
            assert seen == list(range(num))  # every sample exactly once
        for s, step in enumerate(per_step):
            assert sum(len(p) for p in step) == min(gb, num - s * gb)
    # all workers agreed on the same shares at every step
    assert all(res[r][1] == res[0][1] for r in range(n))
    assert all(sum(h) == gb for h in res[0][1])


def test_shares_follow_real_work_and_equalise_compute():
    """Three workers whose per-sample time differs 1 : 2 : 4, plus a fixed part (sleeps:
    threads share one interpreter): the slow worker gets less."""
    gb, per, fixed = 120, [5e-4, 1e-3, 2e-3], 5e-3

    def make(group):
        return BalancedLoader((torch.randn(2400, 4),), gb, device="cpu", group=group,
                              config=BalanceConfig(window=8))

    def body(rank, loader):
        for (x,) in loader:
            time.sleep(fixed + per[rank] * len(x))
        loader.finish()
        return loader.balancer.history[-1].tolist(), loader.spreads

    res = run_workers(3, make, body)
    sizes, spreads = res[0]
    assert sum(sizes) == gb and sizes[0] > sizes[1] > sizes[2], sizes
    # one measured spread per exchange (every `every` steps: 2 by default)
    assert len(spreads) == 20 // BalanceConfig().every and all(s >= 1 for s in spreads if s == s)


def test_sampler_form_with_a_dataloader_and_metrics_rows(tmp_path):
    ds = torch.utils.data.TensorDataset(torch.arange(50).float(), torch.arange(50))
    got = {}

    class Log:
        def __init__(self):
            self.rows = []

        def write(self, step, table):
            self.rows.append((step, table))

    def make(group):
        return BalancedBatchSampler(len(ds), 16, device=torch.device("cpu"), group=group, seed=3, logger=Log())

    def body(rank, sampler):
        dl = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
        got[rank] = [y.tolist() for _x, y in dl]
        sampler.finish()
        return sampler.logger.rows

    rows = run_workers(2, make, body)
    assert sorted(i for r in got.values() for b in r for i in b) == list(range(50))
    assert len(got[0]) == len(got[1]) == 4
    every = BalanceConfig().every  # a row per exchange (every `every` steps)
    assert [s for s, _ in rows[0]] == [s for s in range(4) if (s + 1) % every == 0]
    table = rows[0][-1][1]
    assert len(table) == 2 and set(table[0]) == set(ROW) and table[0]["samples"] + table[1]["samples"] == 2


def test_one_worker_loader_matches_plain_training():
    """One process: the loader's batches in its seeded order train exactly as a plain loop does."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))

    def model():
        torch.manual_seed(1)
        return torch.nn.Linear(5, 3)

    m1, m2 = model(), model()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    loader = BalancedLoader((x, y), 16, device="cpu", group=ThreadGroup(1).group(0), seed=5, optimizer=o1,
                            model=m1)
    for epoch in range(2):
        for xb, yb in loader:
            o1.zero_grad()
            torch.nn.functional.cross_entropy(m1(xb), yb).backward()
            o1.step()
        order = loader.batches.sampler.order(epoch)
        for s in range(4):
            idx = torch.from_numpy(order[s * 16:(s + 1) * 16])
            o2.zero_grad()
            torch.nn.functional.cross_entropy(m2(x[idx]), y[idx]).backward()
            o2.step()
    torch.testing.assert_close(m1.state_dict(), m2.state_dict())
    # the memory estimate ran: parameters count towards the reserved bytes
    assert loader.balancer.cfg.memory_per_sample > 0 and loader.balancer.cfg.reserved_bytes > 0


def test_bad_arguments_are_user_errors():
    from hetrain.errors import UserError

    g = ThreadGroup(2).group(0)
    with pytest.raises(UserError, match="smaller than the 2 workers"):
        BalancedLoader((torch.zeros(10),), 1, device="cpu", group=g)
    with pytest.raises(UserError, match="map-style dataset"):
        BalancedLoader(iter([1, 2]), 4, device="cpu", group=g)
    with pytest.raises(UserError, match="memory_per_sample=BYTES"):
        BalancedLoader((torch.zeros(10, 3),), 4, device="cpu", group=ThreadGroup(1).group(0),
                       model=torch.nn.Linear(5, 2))


def test_position_resumes_mid_epoch_on_another_number_of_workers():
    """A position committed after a step (the optimizer's step hook moved it) resumes with
    the next step; on a different number of workers the rest of the epoch is every
    remaining sample once, and the epochs left follow."""
    data = torch.arange(40)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def make(group, optimizer=None):
        return BalancedLoader(torch.utils.data.TensorDataset(data), 8, device="cpu", group=group, seed=3,
                              optimizer=optimizer)

    first = make(ThreadGroup(1).group(0), opt)
    seen, saved = [], None
    for epoch in first.epochs(3):
        for (x,) in first:
            seen.append((epoch, x.tolist()))
            opt.step()  # the update is applied: the position is past this step
            if (epoch, first.step) == (1, 2):
                saved = first.state_dict()
                break
        if saved is not None:
            break
    assert saved["epoch"] == 1 and saved["step"] == 2 and len(seen) == 5 + 2

    def body(rank, loader):
        loader.load_state_dict(saved)
        got = []
        for epoch in loader.epochs(3):
            got.append((epoch, [x.tolist() for (x,) in loader]))
        return got, loader.state_dict()

    res = run_workers(2, make, body)
    epochs = [e for e, _ in res[0][0]]
    assert epochs == [1, 2] and [e for e, _ in res[1][0]] == epochs
    rest = sorted(i for r in range(2) for b in res[r][0][0][1] for i in b)
    done = [i for e, b in seen if e == 1 for i in b]
    assert sorted(done + rest) == list(range(40))  # epoch 1: the 2 steps before the commit, then the rest once
    assert sorted(i for r in range(2) for b in res[r][0][1][1] for i in b) == list(range(40))
    assert (res[0][1]["epoch"], res[0][1]["step"]) == (3, 0)  # past the end: a restart would train no more
    resumed = make(ThreadGroup(1).group(0))
    resumed.load_state_dict(res[0][1])
    assert list(resumed.epochs(3)) == []
    with pytest.raises(Exception, match="seed=3"):
        make(ThreadGroup(1).group(0)).batches.load_state_dict({**saved, "seed": 4})


def test_loader_resumes_with_a_new_global_batch_after_the_samples_seen():
    """A job restarted with another global batch (a scheduler adapting it) takes the
    committed position of the old one: the epoch goes on after the samples already seen,
    cut into the new batches, and the next epoch is whole."""
    data = torch.arange(40)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    first = BalancedLoader(torch.utils.data.TensorDataset(data), 8, device="cpu", group=ThreadGroup(1).group(0),
                           seed=5, optimizer=opt)
    seen = []
    for (x,) in first:
        seen.extend(x.tolist())
        opt.step()
        if first.step == 3:
            break
    saved = first.state_dict()
    resumed = BalancedLoader(torch.utils.data.TensorDataset(data), 12, device="cpu", group=ThreadGroup(1).group(0),
                             seed=5)
    resumed.load_state_dict(saved)
    assert len(resumed) == 2  # 40 - 24 seen = 16 samples: batches of 12 and 4
    rest = [x.tolist() for (x,) in resumed]
    assert [len(b) for b in rest] == [12, 4]
    order = np.random.default_rng((5, 0)).permutation(40).tolist()
    assert seen + sum(rest, []) == order  # the epoch's order, every sample once
    nxt = [x.tolist() for epoch in resumed.epochs(2) for (x,) in resumed]
    assert sorted(sum(nxt, [])) == list(range(40)) and all(len(b) == 12 for b in nxt[:-1])
