"""Horovod's torch API on hetrain (`import hetrain as hvd`): every collective, reduction
op, DistributedOptimizer option, SyncBatchNorm and join, run by real workers fed
different inputs (tests/scripts/hvd_calls.py) and compared with single-process
references computed here from the same inputs; plus the one-process forms and the
errors for names hetrain does not provide."""
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hetrain
from hetrain.errors import UserError
from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
import hvd_inputs as I  # noqa: E402


def _adasum_pair(a, b):
    """The paper's formula for two vectors, written out independently of hetrain."""
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot, na, nb = (a64 @ b64), (a64 @ a64), (b64 @ b64)
    ca = 1 - dot / (2 * na) if na > 0 else 1.0
    cb = 1 - dot / (2 * nb) if nb > 0 else 1.0
    return (ca * a64 + cb * b64).to(a.dtype).reshape(a.shape)


def _adasum(ts):
    level = list(ts)
    while len(level) > 1:
        level = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)] + (
            [level[-1]] if len(level) % 2 else [])
    return level[0]


def _reduce(op, ts):
    s = torch.stack(ts)
    return {"Average": s.mean(0), "Sum": s.sum(0), "Min": s.min(0).values, "Max": s.max(0).values,
            "Product": s.prod(0), "Adasum": _adasum(ts)}[op]


def _grads(model, xb, yb):
    model.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    return [p.grad.clone() for p in model.parameters()]


def _train_reference(key, n):
    """One process: the workers' gradients combined as the optimizer's option says."""
    if key == "adasum":  # each worker steps its own SGD (own momentum); updates combined by Adasum
        models = [I.model() for _ in range(n)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
        for step in range(I.STEPS):
            start = [p.detach().clone() for p in models[0].parameters()]
            for k in range(n):
                _grads(models[k], *I.batch(k, step))
                opts[k].step()
                scheds[k].step()
            deltas = [[p.detach() - s for p, s in zip(m.parameters(), start)] for m in models]
            new = [s + _adasum([d[j] for d in deltas]) for j, s in enumerate(start)]
            for m in models:
                with torch.no_grad():
                    for p, v in zip(m.parameters(), new):
                        p.copy_(v)
        return models[0].state_dict()
    model = I.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(I.STEPS):
        per_rank = [_grads(model, *I.batch(k, step)) for k in range(n)]
        for j, p in enumerate(model.parameters()):
            s = torch.stack([g[j] for g in per_rank])
            p.grad = s.sum(0) if key == "sum" else s.mean(0)
        opt.step()
        sched.step()
    return model.state_dict()


def _join_reference(n):
    """Rank r trains uneven_steps(r) steps; each step averages over the ranks still in."""
    model = I.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = []
    for step in range(max(I.uneven_steps(k) for k in range(n))):
        active = [k for k in range(n) if I.uneven_steps(k) > step]
        losses, per_rank = [], []
        for k in active:
            model.zero_grad()
            loss = F.cross_entropy(model(I.batch(k, step)[0]), I.batch(k, step)[1])
            loss.backward()
            losses.append(loss.detach())
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for j, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[j] for g in per_rank]).mean(0)
        opt.step()
        metrics.append(torch.stack(losses).mean())
    return model.state_dict(), torch.stack(metrics)


def _syncbn_reference(n):
    bn = nn.BatchNorm1d(4)
    xs = [I.bn_batch(k).requires_grad_() for k in range(n)]
    y = bn(torch.cat(xs))
    (y * torch.arange(1.0, 3.0)).sum().backward()
    rows = [x.shape[0] for x in xs]
    return y.detach().split(rows), [x.grad for x in xs], bn


def _close(got, want, msg, **tol):
    torch.testing.assert_close(got, want, msg=msg, **tol)


def _check_collectives(res, r, n):
    ins = lambda i, shape=(5, 3): [I.tensor(k, i, shape) for k in range(n)]  # noqa: E731
    assert res["basics"] == [r, n, r, n, 0, 1, True, True, False, True]
    for i, op in enumerate(I.OPS):
        _close(res[f"allreduce.{op}"], _reduce(op, ins(i)), f"rank {r} allreduce op={op}")
    _close(res["allreduce.average_false"], _reduce("Sum", ins(0)), "average=False")
    _close(res["allreduce.scaled"], _reduce("Average", ins(0)) * 0.5, "pre/postscale")
    _close(res["allreduce.int_sum"], sum(torch.arange(4) + k for k in range(n)), "int sum", rtol=0, atol=0)
    _close(res["allreduce.fp16"], _reduce("Average", ins(0)), "fp16 compression", rtol=1e-2, atol=1e-2)
    assert res["allreduce_.is_same"] is True
    _close(res["allreduce_"], _reduce("Sum", ins(1)), "allreduce_")
    assert res["allreduce_async.poll"] is True
    _close(res["allreduce_async"], _reduce("Average", ins(0)), "allreduce_async")
    _close(res["allreduce_async_"], _reduce("Max", ins(1)), "allreduce_async_")
    want = [_reduce("Sum", ins(0)), _reduce("Sum", ins(1, (7,))), sum(torch.tensor([k, 2 * k]) for k in range(n))]
    for g, w in zip(res["grouped_allreduce"], want):
        _close(g, w, "grouped_allreduce")
    _close(res["grouped_allreduce.adasum"][1], _reduce("Adasum", ins(1, (7,))), "grouped Adasum (per tensor)")
    _close(res["grouped_allreduce_"][0], _reduce("Average", ins(0)), "grouped_allreduce_")
    _close(res["grouped_allreduce_async"][0], _reduce("Min", ins(2)), "grouped_allreduce_async")
    gathered = torch.cat([I.gather_rows(k) for k in range(n)])
    _close(res["allgather"], gathered, "allgather", rtol=0, atol=0)
    _close(res["allgather_async"], gathered, "allgather_async", rtol=0, atol=0)
    for k, obj in enumerate(res["allgather_object"]):
        assert obj["rank"] == k and obj["name"] == f"w{k}" and torch.equal(obj["t"], torch.arange(k + 1))
    _close(res["broadcast"], I.tensor(n - 1, 3), "broadcast", rtol=0, atol=0)
    _close(res["broadcast_"], I.tensor(min(1, n - 1), 3), "broadcast_", rtol=0, atol=0)
    _close(res["broadcast_async"], torch.tensor([0]), "broadcast_async")
    assert res["broadcast_object"] == {"epoch": 10 + min(1, n - 1)}
    _close(res["alltoall"], torch.cat([torch.arange(2.0 * n)[2 * r: 2 * r + 2] + 10 * k for k in range(n)]),
           "alltoall")
    out, recv = res["alltoall.splits"]
    chunks = [I.a2a_input(k, n).split(I.a2a_splits(k, n))[r] for k in range(n)]
    _close(out, torch.cat(chunks), "alltoall splits", rtol=0, atol=0)
    assert recv.tolist() == [I.a2a_splits(k, n)[r] for k in range(n)]
    full = ins(4, (2 * n + 1, 2))
    base, extra = divmod(2 * n + 1, n)
    lo = r * base + min(r, extra)
    hi = lo + base + (1 if r < extra else 0)
    _close(res["reducescatter"], _reduce("Average", full)[lo:hi], "reducescatter")
    _close(res["reducescatter.sum"], _reduce("Sum", full)[lo:hi], "reducescatter Sum")
    _close(res["alltoall_async"], res["alltoall"], "alltoall_async", rtol=0, atol=0)
    _close(res["reducescatter_async"], res["reducescatter"], "reducescatter_async", rtol=0, atol=0)
    _close(res["grouped_allgather"][0], gathered, "grouped_allgather", rtol=0, atol=0)
    _close(res["grouped_allgather"][1], gathered * 2, "grouped_allgather", rtol=0, atol=0)
    _close(res["grouped_reducescatter"][0], res["reducescatter.sum"], "grouped_reducescatter")
    ys, dxs, bn = _syncbn_reference(n)
    got = res["syncbn"]
    _close(got["y"], ys[r], "SyncBatchNorm output", rtol=1e-4, atol=1e-5)
    _close(got["dx"], dxs[r], "SyncBatchNorm input grad", rtol=1e-4, atol=1e-5)
    _close(got["dw"], bn.weight.grad, "SyncBatchNorm weight grad", rtol=1e-4, atol=1e-5)
    _close(got["mean"], bn.running_mean, "SyncBatchNorm running mean", rtol=1e-4, atol=1e-5)
    _close(got["var"], bn.running_var, "SyncBatchNorm running var", rtol=1e-4, atol=1e-5)


def _check_training(res, r, n):
    for key in ("avg", "sum", "predivide", "adasum", "bpps"):
        want = _train_reference({"predivide": "avg", "bpps": "avg"}.get(key, key), n)
        assert res[f"opt.{key}.isinstance"] == [True, True, "SGD"], key
        assert res[f"opt.{key}.lr"] == pytest.approx(0.025), key  # StepLR drove the wrapped optimizer
        assert res[f"opt.{key}.state_keys"] == [0, 1, 2, 3], key
        for name, w in want.items():
            _close(res[f"opt.{key}"][name], w, f"rank {r} DistributedOptimizer {key} {name}", rtol=1e-5, atol=1e-6)
    hits = torch.zeros(6)
    for k in range(n):
        hits[k] += 1
        hits[k + 1] += 1
    _close(res["sparse_as_dense"], 1.0 - (hits / n).unsqueeze(1).expand(6, 2), "sparse_as_dense")
    model, metrics = _join_reference(n)
    assert res["join.last"] == n - 1
    for name, w in model.items():
        _close(res["join.model"][name], w, f"rank {r} join model {name}", rtol=1e-5, atol=1e-6)
    _close(res["join.metrics"], metrics[: I.uneven_steps(r)], f"rank {r} join metrics", rtol=1e-5, atol=1e-6)
    same, t = res["push_pull_inplace"]
    assert same is True
    _close(t, torch.full((3,), sum(range(n)) / n), "push_pull_inplace")


@pytest.mark.parametrize("n, mode", [(2, "byteps"), pytest.param(3, "allreduce", marks=pytest.mark.slow)])
def test_horovod_calls_match_single_process(launch, tmp_path, n, mode):
    out = tmp_path / "res"
    rc, log, _ = launch("hvd_calls.py", str(out), cluster=small_cluster(workers=n, cpus=1), mode=mode, limit=400)
    assert rc == 0, log
    for r in range(n):
        res = torch.load(out / f"rank{r}.pt", weights_only=True)
        _check_collectives(res, r, n)
        _check_training(res, r, n)


def test_one_process_forms_and_errors():
    """`python script.py`: a one-worker job; bad arguments and missing names say what to use."""
    t = torch.arange(4.0)
    for op in (hetrain.Average, hetrain.Sum, hetrain.Min, hetrain.Max, hetrain.Product, hetrain.Adasum):
        torch.testing.assert_close(hetrain.allreduce(t, op=op), t)
    assert hetrain.allgather_object("x") == ["x"]
    assert hetrain.is_initialized() and hetrain.cross_size() == 1 and hetrain.join() == 0
    with pytest.raises(UserError, match="op= or average=, not both"):
        hetrain.allreduce(t, average=True, op=hetrain.Sum)
    with pytest.raises(UserError, match="not an integer; use op=hetrain.Sum"):
        hetrain.allreduce(torch.arange(3))
    with pytest.raises(UserError, match="Adasum combines floating-point"):
        hetrain.allreduce(torch.arange(3), op=hetrain.Adasum)
    with pytest.raises(UserError, match="splits="):
        hetrain.alltoall(t, splits=[3])
    with pytest.raises(UserError, match="reducescatter takes"):
        hetrain.reducescatter(t, op=hetrain.Max)
    model = I.model()
    with pytest.raises(UserError, match="only for op=hetrain.Average"):
        hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hetrain.Sum,
                                     gradient_predivide_factor=2.0)
    with pytest.raises(UserError, match="Average, Sum or Adasum"):
        hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hetrain.Max)
    emb = nn.Embedding(4, 2, sparse=True)
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(UserError, match="sparse_as_dense=True"):
        opt.step()
    with pytest.raises(UserError, match="already a DistributedOptimizer"):
        hetrain.DistributedOptimizer(opt)
    adam = hetrain.DistributedOptimizer(torch.optim.Adam(model.parameters()), groups=2)
    assert isinstance(adam, torch.optim.Adam) and type(adam).__name__ == "Adam"
    with pytest.raises(AttributeError, match="hetrain.allreduce"):
        hetrain.allreduc  # noqa: B018
    with pytest.raises(AttributeError, match="process sets are not supported"):
        hetrain.add_process_set  # noqa: B018
    assert not hasattr(hetrain, "nonexistent_name")


@pytest.mark.slow
def test_worker_ending_early_without_join_is_named(launch):
    rc, log, _ = launch("uneven_no_join.py", cluster=small_cluster(workers=2, cpus=1), mode="allreduce", timeout=60)
    assert rc != 0
    assert "1 of 2 workers ended the job while the others went on training" in log, log
    assert "hetrain.join()" in log and "timed out" not in log.lower(), log


def test_a_step_with_the_loaders_total_is_not_announced_to_joined_workers(monkeypatch):
    """join's per-exchange announcement runs for steps without a known total, and is
    skipped when the step's total came with its batch (BalancedLoader's contract: every
    worker takes every step), so such a step runs no collective besides its buckets."""
    from hetrain.api import optimizer as api_opt

    calls = []
    real = api_opt._join.announce
    monkeypatch.setattr(api_opt._join, "announce", lambda *a: calls.append(a) or real(*a))
    model = I.model()
    opt = hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), overlap=True)
    x = torch.randn(4, *next(model.parameters()).shape[1:])
    for total, announced in ((None, True), (8, False), (None, True)):
        calls.clear()
        opt.set_batch_size(4, total=total)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        assert bool(calls) == announced, (total, calls)
        assert all(p.grad is not None for p in model.parameters())
