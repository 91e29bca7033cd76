"""push_pull on a subgroup of the workers (a pipeline stage's replicas), in-process.

The collectives are stand-ins that record which process group they ran on and add
what the other members would contribute, so the group's step header, batch weighting,
manifests and mismatch errors are checked without processes. The real multi-process
run is tests/heterps/test_pipeline.py (a stage of two replicas with unequal batches
equals one process)."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hetrain.cluster.spec import parse_cluster
from hetrain.comm.engine import PushPull
from hetrain.comm.group import Group, make_groups
from hetrain.comm.layout import Manifest, TensorMismatchError
from hetrain.errors import UserError
from hetrain.runtime.devices import group_backend
from hetrain.runtime.env import CommConfig
from hetrain.runtime.topology import build_topology


def _machines(n, cuda=(), node=None):
    return {"machines": [{"name": f"m{i}", "role": "worker", "device": {"cuda": i in cuda},
                          **({"node": node[i]} if node else {})} for i in range(n)]}


def _ctx(cluster: dict, rank: int, mode: str = "allreduce"):
    c = parse_cluster(cluster)
    topo = build_topology(c, mode)
    return SimpleNamespace(distributed=True, topology=topo, cluster=c, comm=CommConfig(mode=mode), rank=rank,
                           world_size=topo.world_size, device=torch.device("cpu"), local_groups=None,
                           num_workers=len(topo.workers), describe=topo.describe, failed=False, nccl_group=None,
                           worker_group="job", bucket=None,
                           peer_error=lambda what, peers, err: RuntimeError(f"{what}: {peers}"))


def test_group_backend_is_nccl_only_for_gpus_of_their_own():
    comm = CommConfig(mode="allreduce")
    own = build_topology(parse_cluster(_machines(4, cuda=(0, 1, 2, 3), node=[0, 1, 2, 3])), "allreduce")
    assert group_backend(own, [1, 3], comm) == "nccl"
    assert group_backend(own, [2], comm) == "gloo"  # one member: nothing to reduce
    assert group_backend(own, [1, 3], CommConfig(mode="allreduce", collective="gloo")) == "gloo"
    # every machine of one node binds cuda:0: two members would share a GPU, which NCCL refuses
    shared = build_topology(parse_cluster(_machines(4, cuda=(0, 1, 2, 3))), "allreduce")
    assert group_backend(shared, [1, 3], comm) == "gloo"
    mixed = build_topology(parse_cluster(_machines(4, cuda=(1,), node=[0, 1, 2, 3])), "allreduce")
    assert group_backend(mixed, [1, 3], comm) == "gloo"  # a CPU member: host collectives


def test_make_groups_creates_every_group_on_every_rank_and_refuses_non_workers(monkeypatch):
    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None, backend=None: made.append(
        (tuple(ranks), backend)) or f"pg{len(made)}")
    ctx = _ctx(_machines(5), rank=3)
    groups = make_groups(ctx, [[0], [1, 3], [2, 4]], ["stage0", "stage1", "stage2"])
    assert made == [((0,), None), ((1, 3), None), ((2, 4), None)]  # the same calls on every rank
    assert [g.member for g in groups] == [False, True, False]
    assert groups[1].gloo == "pg2" and groups[0].gloo is None and groups[1].nccl is None
    assert groups[1].global_rank(1) == 3
    with pytest.raises(UserError, match=r"rank\(s\) \[7\]"):
        make_groups(ctx, [[0, 7]], ["x"])
    servers = _ctx({"machines": [{"name": "a", "role": "worker", "device": {}},
                                 {"name": "b", "role": "worker", "device": {}},
                                 {"name": "c", "role": "cpu"}]}, rank=0, mode="ps")
    with pytest.raises(UserError, match="summation servers"):
        make_groups(servers, [[0, 2]], ["x"])
    with pytest.raises(UserError, match="not a member"):
        PushPull(ctx, groups[0])


class _Peer:
    """Stand-in collectives for a group of two: add the other member's contribution (an
    all-reduce, or the swap two members make of small host buckets: p2p.Swap)."""

    def __init__(self, monkeypatch, group, peer_digest_of, peer_weight, peer_grads, peer_manifest=None):
        self.calls = []
        self.peer_weight = peer_weight
        self.peer_grads = peer_grads
        self.peer_digest_of = peer_digest_of
        self.peer_manifest = peer_manifest
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "isend", self.isend)
        monkeypatch.setattr(dist, "irecv", self.irecv)
        for name in ("send", "recv", "reduce", "broadcast"):
            monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} called"))

    def isend(self, t, dst=None, tag=0, group=None):
        self.calls.append(("isend", group, t.numel()))
        return _Done()

    def irecv(self, t, src=None, tag=0, group=None):  # the peer's whole bucket: its share (b/Σb)·g
        self.calls.append(("irecv", group, t.numel()))
        t.copy_(self.peer_grads[: t.numel()] * (self.peer_weight / self.total))
        return _Done()

    def all_reduce(self, t, group=None, async_op=False):
        self.calls.append(("all_reduce", group, t.numel()))
        if t.dtype == torch.int64:  # the step header [Σd, Σd², Σb, Σstop, Σworkers, Σnumel, Σconflict]
            d = self.peer_digest_of(int(t[0]))
            t += torch.tensor([d, d * d, self.peer_weight, 0, 1, int(t[5]), 0])
        else:  # a bucket: this worker's share (b/Σb)·g, plus the peer's
            t += self.peer_grads * (self.peer_weight / self.total)
        return _Done()

    def all_gather(self, out, t, group=None):
        """Manifests: lengths first (int64[1]), then UTF-8 bytes padded to the longest."""
        self.calls.append(("all_gather", group, t.numel()))
        raw = self.peer_manifest.encode()
        if t.dtype == torch.int64:
            out[0].copy_(t)  # this rank is the group's first member
            out[1].fill_(len(raw) + 1)
            return
        out[0].zero_()
        out[0][: t.numel()].copy_(t)
        out[1].zero_()
        out[1][: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class _Done:
    def is_completed(self):
        return True

    def wait(self):
        return True


def test_group_push_pull_is_the_batch_weighted_average_over_the_group(monkeypatch):
    ctx = _ctx(_machines(4), rank=1)
    group = Group("stage1", (1, 3), gloo="stage1-pg")
    mine = [torch.full((3, 4), 2.0), torch.full((5,), -1.0)]
    theirs = torch.cat([torch.full((12,), 6.0), torch.full((5,), 3.0)])
    named = [("fc.weight", mine[0]), ("fc.bias", mine[1])]
    peer = _Peer(monkeypatch, group, peer_digest_of=lambda d: d, peer_weight=3, peer_grads=theirs,
                 peer_manifest=Manifest.of(named))
    peer.total = 1 + 3
    eng = PushPull(ctx, group)
    for _ in range(2):  # the second step reuses the agreed layout
        ts = [t.clone() for t in mine]
        eng.push_pull([(n, t) for (n, _), t in zip(named, ts)], weight=1)
        torch.testing.assert_close(ts[0], torch.full((3, 4), (1 * 2.0 + 3 * 6.0) / 4))
        torch.testing.assert_close(ts[1], torch.full((5,), (1 * -1.0 + 3 * 3.0) / 4))
    # every collective ran on the group's process group, never the job's; the bucket (17
    # floats, two members) was swapped with the other member, not all-reduced
    assert {g for _, g, _ in peer.calls} == {"stage1-pg"}
    assert ("irecv", "stage1-pg", 17) in peer.calls and ("all_reduce", "stage1-pg", 17) not in peer.calls
    assert eng.protocol.epoch == 1


def test_group_mismatch_names_the_group_and_its_members_by_job_rank(monkeypatch):
    ctx = _ctx(_machines(4), rank=1)
    group = Group("stage1", (1, 3), gloo="stage1-pg")
    other = Manifest.of([("fc.weight", torch.empty(3, 5)), ("fc.bias", torch.empty(5))])
    peer = _Peer(monkeypatch, group, peer_digest_of=lambda d: other.digest(), peer_weight=1,
                 peer_grads=None, peer_manifest=other)
    eng = PushPull(ctx, group)
    with pytest.raises(TensorMismatchError) as err:
        eng.push_pull([("fc.weight", torch.zeros(3, 4)), ("fc.bias", torch.zeros(5))], weight=2)
    msg = str(err.value)
    assert "the workers of stage1 (ranks 1, 3)" in msg
    assert "'fc.weight' has shape (3, 4) on rank(s) [1]; shape (3, 5) on rank(s) [3]" in msg, msg
    assert ctx.failed and {g for _, g, _ in peer.calls} == {"stage1-pg"}


def test_a_group_of_one_moves_nothing(monkeypatch):
    for name in ("all_reduce", "all_gather", "isend", "irecv"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} called"))
    ctx = _ctx(_machines(3), rank=2)
    eng = PushPull(ctx, Group("stage2", (2,), gloo="pg"))
    t = torch.full((4,), 5.0)
    eng.push_pull([("w", t)], weight=7)
    assert torch.equal(t, torch.full((4,), 5.0))
    with pytest.raises(UserError, match="weight 0"):
        eng.push_pull([("w", t)], weight=0)


def test_a_lost_member_is_blamed_on_the_group_s_other_members(monkeypatch):
    """A collective that fails (a member died) raises the context's peer error, told what
    the group was doing and which members it waited on (the context then names the rank
    the launcher reported dead)."""
    ctx = _ctx(_machines(4), rank=1)
    group = Group("stage 1", (1, 3), gloo="pg")

    def broken(t, group=None, async_op=False):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "all_reduce", broken)
    eng = PushPull(ctx, group)
    with pytest.raises(RuntimeError, match=r"exchanging the step header of stage 1 \(ranks 1, 3\): \[3\]"):
        eng.push_pull([("w", torch.zeros(4))], weight=1)
    # past the header, the buckets' all-reduce
    calls = []

    def header_then_broken(t, group=None, async_op=False):
        if t.dtype == torch.int64:
            d = int(t[0])
            t += torch.tensor([d, d * d, 1, 0, 1, int(t[5]), 0])
            calls.append("header")
            return _Done()
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "all_reduce", header_then_broken)
    for name in ("isend", "irecv"):  # two members swap small buckets (p2p.Swap): it fails the same way
        monkeypatch.setattr(dist, name, lambda *a, **k: broken(None))
    monkeypatch.setattr(dist, "all_gather", lambda out, t, group=None: [o.copy_(t) for o in out])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    eng = PushPull(ctx, group)
    with pytest.raises(RuntimeError, match=r"all-reducing gradients among stage 1 \(ranks 1, 3\): \[3\]"):
        eng.push_pull([("w", torch.zeros(4))], weight=1)
    assert calls == ["header"]
