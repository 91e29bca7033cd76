"""Sparse parameter server: sharding, pull/push of only the batch's rows, and per-row
SGD/Adagrad equal to a dense reference update."""
import pytest
import torch
from torch.testing import assert_close

from hetrain.errors import UserError
from hetrain.pipeline.sparse_ps import ShardLayout, ShardState, SparseOptim, shards_needed


def test_layout_partitions_every_key_once():
    lay = ShardLayout([7, 5, 11], 3)
    keys = torch.arange(lay.total)
    seen = torch.zeros(lay.total, dtype=torch.long)
    for j, (pos, local) in enumerate(lay.split(keys)):
        assert local.numel() == lay.rows_on(j)
        assert torch.equal(keys[pos] % 3, torch.full_like(pos, j))
        assert torch.equal(local * 3 + j, keys[pos])
        seen[pos] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    full = torch.randn(lay.total, 4)
    back = torch.empty_like(full)
    for j in range(3):
        back[j::3] = lay.shard_of(full, j)
    assert torch.equal(back, full)
    assert torch.equal(lay.keys(1, torch.tensor([0, 6])), torch.tensor([7, 8]))  # ids wrap mod rows


def test_tables_larger_than_the_memory_cap_are_split():
    rows, dim = 10_000, 16
    need = rows * dim * 4 * 2  # rows + Adagrad state
    n = shards_needed(rows, dim, memory_cap=need / 3.5, requested=1)
    assert n == 4
    lay = ShardLayout([rows], n)
    assert max(lay.rows_on(j) for j in range(n)) * dim * 4 * 2 <= need / 3.5
    assert shards_needed(rows, dim, memory_cap=need * 10, requested=2) == 2
    with pytest.raises(UserError, match="at least one"):
        shards_needed(rows, dim, 1e9, requested=0)


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_sparse_push_pull_equals_dense_reference(kind):
    torch.manual_seed(0)
    rows, dim, n_shards, lr = 50, 3, 3, 0.1
    full = torch.randn(rows, dim)
    lay = ShardLayout([20, 30], n_shards)
    opt = SparseOptim(kind=kind, lr=lr)
    shards = [ShardState(lay.shard_of(full, j), opt) for j in range(n_shards)]
    ref = torch.nn.Parameter(full.clone())
    ref_opt = torch.optim.SGD([ref], lr=lr) if kind == "sgd" else torch.optim.Adagrad([ref], lr=lr, eps=opt.eps)
    touched_all = torch.zeros(rows, dtype=torch.bool)
    for step in range(3):
        for s in shards:
            s.pulled.zero_()
        dense_grad = torch.zeros(rows, dim)
        batch_keys = torch.zeros(rows, dtype=torch.bool)
        for mb in range(2):  # two micro-batches per step, each pushes its own rows
            keys = torch.unique(torch.randint(0, rows, (9,)))
            batch_keys[keys] = True
            pulled = torch.empty(keys.numel(), dim)
            for j, (pos, local) in enumerate(lay.split(keys)):
                pulled[pos] = shards[j].pull(local)
            assert_close(pulled, ref.detach()[keys])  # pulls see the state after the last step
            g = torch.randn(keys.numel(), dim)
            dense_grad[keys] += g
            for j, (pos, local) in enumerate(lay.split(keys)):
                shards[j].push(local, g[pos])
        before = torch.cat([s.rows.clone() for s in shards])
        applied = sum(s.apply() for s in shards)
        assert applied == int(batch_keys.sum())
        # only the batch's rows were pulled and changed
        for j, s in enumerate(shards):
            mine = torch.arange(j, rows, n_shards)
            assert torch.equal(s.pulled, batch_keys[mine])
        ref_opt.zero_grad()
        ref.grad = dense_grad
        ref_opt.step()
        touched_all |= batch_keys
        now = torch.empty(rows, dim)
        for j, s in enumerate(shards):
            now[j::n_shards] = s.rows
        assert_close(now, ref.detach(), rtol=1e-6, atol=1e-6)
        after = torch.cat([s.rows for s in shards])
        changed = (after != before).any(1)
        order = torch.cat([torch.arange(j, rows, n_shards) for j in range(n_shards)])
        assert not changed[~batch_keys[order]].any()
    assert_close(torch.cat([s.rows for s in shards]).sum(), ref.detach().sum(), rtol=1e-5, atol=1e-5)
    assert not touched_all.all()  # some rows never in a batch: they must never have moved
    assert_close(torch.cat([s.rows for s in shards])[~touched_all[torch.cat([torch.arange(j, rows, n_shards) for j in range(n_shards)])]],
                 full[torch.cat([torch.arange(j, rows, n_shards) for j in range(n_shards)])][~touched_all[torch.cat([torch.arange(j, rows, n_shards) for j in range(n_shards)])]], rtol=0, atol=0)


def test_shard_state_checkpoint_round_trip():
    s = ShardState(torch.randn(4, 2), SparseOptim("adagrad", 0.1))
    s.push(torch.tensor([1]), torch.ones(1, 2))
    s.apply()
    d = s.state_dict()
    t = ShardState(torch.zeros(4, 2), SparseOptim("adagrad", 0.1))
    t.load_state_dict(d)
    assert torch.equal(t.rows, s.rows) and torch.equal(t.acc, s.acc)
    with pytest.raises(ValueError, match="same plan"):
        ShardState(torch.zeros(5, 2), SparseOptim()).load_state_dict(d)
    with pytest.raises(UserError, match="adagrad"):
        SparseOptim(kind="adam")
