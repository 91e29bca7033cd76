"""The calls a Horovod/BytePS script makes (local_rank, broadcast_optimizer_state,
broadcast_object, push_pull on one tensor, push_pull_async, backward_passes_per_step,
synchronize + skip_synchronize, compression) in real processes, each compared with a
single-process reference; workers start from different states."""
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hetrain
from hetrain.errors import UserError
from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
from reference import data, make_model  # noqa: E402

N_WORKERS = 3


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, (where, a, b)
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, a.keys(), b.keys())
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _optimizers_of_rank0():
    """Rank 0's optimizers as the script builds and steps them."""
    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.full_like(p, float(step + 1))
        adam.step()
        sgd.step()
    return adam.state_dict(), sgd.state_dict()


def _train_single(steps=3, global_batch=24, clip=None, momentum=0.9):
    x, y = data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        idx = torch.arange(step * global_batch, (step + 1) * global_batch)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict()


@pytest.mark.slow
def test_ported_script_calls_match_single_process(launch, tmp_path):
    out = tmp_path / "res"
    rc, log, _ = launch("api_calls.py", str(out), cluster=small_cluster(workers=N_WORKERS, cpus=1),
                        extra=("--partition-bytes", "2048"))
    assert rc == 0, log
    res = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(N_WORKERS)]

    torch.manual_seed(101)  # rank 1's weights: the root of broadcast_parameters
    net = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        net[1].num_batches_tracked.fill_(2**40 + 1)
    adam0, sgd0 = _optimizers_of_rank0()
    accumulated = _train_single()
    clipped = _train_single(clip=0.05, momentum=0.0)
    weights = torch.arange(1.0, N_WORKERS + 1)
    for r, got in enumerate(res):
        assert got["local"] == (r, N_WORKERS)  # one node runs every worker
        _same(net.state_dict(), got["params"], f"rank {r} params")
        _same(adam0, got["adam"], f"rank {r} adam")
        _same(sgd0, got["sgd"], f"rank {r} sgd")
        _same({"epoch": 3, "names": ("a", "b"), "t": torch.arange(3), 7: [None, 1.5, b"x"]}, got["object"],
              f"rank {r} object")
        assert "builtins.object" in got["refused"] and "unpickled" in got["refused"], got["refused"]
        for i, shape in enumerate([(3,), (2, 5), (7,)]):
            base = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
            per_rank = torch.stack([base * (k + 1) + 10 * i for k in range(N_WORKERS)])
            want = (per_rank.sum(0) if i == 1 else
                    (per_rank * weights.view(-1, *[1] * len(shape))).sum(0) / weights.sum())
            torch.testing.assert_close(got["push_pull"][i], want, msg=f"rank {r} push_pull t{i}")
            torch.testing.assert_close(got["push_pull_async"][i], got["push_pull"][i], rtol=0, atol=0)
        torch.testing.assert_close(got["inplace"], torch.full((4,), 1.0))
        for key in ("accumulated_overlap0", "accumulated_overlap1"):
            for name, want in accumulated.items():
                torch.testing.assert_close(got[key][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {key} {name}")
        for name, want in clipped.items():
            torch.testing.assert_close(got["clipped"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} clip {name}")
        assert "--codec fp16" in got["fp16"], got["fp16"]
    assert "refused on rank 0" in res[1]["refused"]  # the others learn why root refused


def test_one_process_calls_and_argument_errors():
    """`python script.py` (no launcher): the same calls work as a one-worker job."""
    t = torch.arange(4.0)
    assert hetrain.local_rank() == 0 and hetrain.local_size() == 1
    torch.testing.assert_close(hetrain.push_pull(t, average=False), t)
    h = hetrain.push_pull_async(t * 2)
    assert hetrain.poll(h)
    torch.testing.assert_close(hetrain.synchronize(h), t * 2)
    with pytest.raises(UserError, match="unknown handle"):
        hetrain.synchronize(h)
    obj = {"a": [1, torch.ones(2)]}
    assert hetrain.broadcast_object(obj) is obj
    for bad, match in [(object(), "builtins.object"), ({"f": lambda: 0}, r"obj\['f'\] is a builtins.function"),
                       ({"a": __import__("numpy").zeros(2)}, "torch.from_numpy")]:
        with pytest.raises(UserError, match=match):
            hetrain.broadcast_object(bad)
    with pytest.raises(UserError, match="root_rank=1 is not a worker rank"):
        hetrain.broadcast_object(1, root_rank=1)
    model = make_model()
    with pytest.raises(UserError, match="backward_passes_per_step=0"):
        hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(UserError, match="not a codec hetrain knows"):
        hetrain.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=3)
    with pytest.raises(UserError, match="tensor must be a torch.Tensor"):
        hetrain.push_pull(3.0)


@pytest.mark.slow
def test_calls_after_shutdown_are_refused_not_a_new_rendezvous(launch):
    rc, log, _ = launch("after_shutdown.py", cluster=small_cluster(workers=2, cpus=0), mode="allreduce", timeout=30)
    assert rc == 0, log
    assert "ran after shutdown" not in log, log
    for r in range(2):
        assert f"rank {r} averaged [1.5, 1.5, 1.5]" in log, log
        for name in ("rank", "push_pull", "broadcast_parameters"):
            assert (f"rank {r} {name} refused: rank {r} (worker on machine w{r}) left the job with "
                    "hetrain.shutdown()") in log, log
