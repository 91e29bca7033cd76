"""The engine's pure parts, in-process: the layout (partitions, spans, touches, pushers),
the credit window, the servers' per-machine weighting, the tag registry, host staging,
and the guard that keeps anything but host memory away from gloo."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from hetrain.cluster import parse_cluster
from hetrain.comm import p2p
from hetrain.comm.engine import PushPull
from hetrain.comm.layout import check_tensors
from hetrain.comm.flatlayout import FlatLayout, balanced_owners
from hetrain.comm.layout import Entry, Manifest
from hetrain.comm.partition import plan_buckets, plan_for
from hetrain.comm.protocol import OK, SLOW, ControlInbox, Header, check_header
from hetrain.comm.staging import HostDirect, HostInPlace, HostWork
from hetrain.comm.layout import TensorMismatchError
from hetrain.comm.transport import AllReduceTransport, HierarchicalTransport, ServerTransport, make_transport
from hetrain.comm.window import CreditWindow, window_partitions
from hetrain.errors import UserError
from hetrain.modes import Sync
from hetrain.runtime.env import CommConfig
from hetrain.runtime.topology import build_topology


def _manifest(shapes):
    return Manifest.of([(f"t{i}", torch.empty(s)) for i, s in enumerate(shapes)])


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8), servers=st.integers(1, 4),
       part=st.integers(1024, 8192), local=st.integers(1, 4))
def test_layout_spans_touches_and_pushers(sizes, servers, part, local):
    manifest = _manifest([(n,) for n in sizes])
    parts = plan_for(np.ones(servers), manifest.numel, part)
    machines = [list(range(local)), [local]]  # one machine with `local` workers, one with one
    lay = FlatLayout.build(manifest, parts, None, machines)
    assert lay.numel == sum(sizes)
    # spans cover each partition exactly, in order, inside their tensors
    for pid, p in enumerate(lay.parts):
        covered = [(lo, hi) for _, lo, hi in lay.spans[pid]]
        assert sum(hi - lo for lo, hi in covered) == p.length
        assert covered == sorted(covered) and (not covered or covered[0][0] == p.start)
        for i, lo, hi in lay.spans[pid]:
            a, b = lay.tensor_range(i)
            assert a <= lo < hi <= b
    # filling every tensor completes every partition exactly once; ranges add up the same way
    filled = [0] * len(lay.parts)
    for i in range(len(sizes)):
        a, b = lay.tensor_range(i)
        mid = (a + b) // 2
        for pid, n in lay.touches(a, mid) + lay.touches(mid, b):
            filled[pid] += n
        assert sum(n for _, n in lay.tensor_touches[i]) == sizes[i]
    assert filled == [p.length for p in lay.parts]
    # one pusher per machine per partition; the multi-worker machine spreads its bytes
    for pid, ps in enumerate(lay.pushers):
        assert len(ps) == 2 and ps[1] == local and ps[0] in machines[0]
        assert ps[0] == lay.owner(pid, local) if local > 1 else ps[0] == 0
    if local > 1 and len(lay.parts) >= local:
        load = np.zeros(local)
        for pid in range(len(lay.parts)):
            load[lay.owner(pid, local)] += lay.sizes[pid]
        assert load.max() - load.min() <= max(lay.sizes)  # balanced to within one partition
    assert sorted(pid for r in range(local) for pid in lay.pushes(r)) == list(range(len(lay.parts))) if local > 1 \
        else True


def test_balanced_owners_are_deterministic_and_even():
    assert balanced_owners([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    assert balanced_owners([8, 1, 1, 1, 1, 8], 2) == [0, 1, 1, 1, 1, 1]
    assert balanced_owners([3], 1) == [0]


def test_layout_with_codecs_sizes_payloads():
    manifest = _manifest([(300,), (40,)])
    parts = plan_for(np.ones(2), manifest.numel, 1024)
    lay = FlatLayout.build(manifest, parts, ["int8", "fp32"])
    assert lay.wire is not None and lay.sizes == tuple(w.nbytes for w in lay.wire)
    assert sum(lay.sizes) < 4 * manifest.numel


def test_window_per_server_and_budget():
    w = CreditWindow.for_job(64 * 1024, 0, unlimited=False)
    assert w.per_server == window_partitions(64 * 1024) == 4
    for _ in range(4):
        assert w.admits(0, 100)
        w.sent(0, 100)
    assert not w.admits(0, 100) and w.admits(1, 100) and w.victim(0) == 0
    w.done(0, 100)
    assert w.admits(0, 100)
    b = CreditWindow.for_job(4096, 1000, unlimited=False)
    assert b.admits(0, 5000)  # an empty window always takes one partition
    b.sent(0, 600)
    assert not b.admits(1, 600) and b.victim(1) is None
    assert CreditWindow.for_job(4096, 1000, unlimited=True).admits(0, 10**9)


def _rows(weights, average):
    return torch.tensor([[1, 7, 100, w, 0, int(a)] for w, a in zip(weights, average)])


def test_servers_weight_each_machine_so_the_result_is_the_batch_weighted_average():
    """Machine 0 has workers 0 and 1 (they pre-scale by b and add), machine 1 has worker 2."""
    weights, machines = [4, 8, 12], [[0, 1], [2]]
    coef, conflict = ControlInbox.coefficients(_rows(weights, [1, 1, 1]), machines)
    assert conflict == -1
    g = [torch.randn(5) for _ in weights]
    pushes = [weights[0] * g[0] + weights[1] * g[1], g[2]]  # what each machine's pusher sends
    got = coef[0] * pushes[0] + coef[1] * pushes[1]
    want = sum(w * x for w, x in zip(weights, g)) / sum(weights)
    torch.testing.assert_close(got, want)
    # plain sums: every factor 1 (the local workers pre-scale by 1)
    coef, _ = ControlInbox.coefficients(_rows(weights, [0, 0, 0]), machines)
    assert coef.tolist() == [1.0, 1.0]
    # empty batches everywhere: zero factors (the workers raise)
    coef, _ = ControlInbox.coefficients(_rows([0, 0, 0], [1, 1, 1]), machines)
    assert coef.tolist() == [0.0, 0.0]


def test_disagreeing_average_flags_on_one_machine_are_named():
    rows = _rows([1, 1, 1], [1, 0, 1])
    coef, conflict = ControlInbox.coefficients(rows, [[0, 1], [2]])
    assert conflict == 0
    assert ControlInbox.verdict(rows, 7, conflict) == SLOW
    assert ControlInbox.verdict(rows, 7, -1) == OK
    h = Header(0, 0, 3, 0, 3, 30, conflict=2 * (conflict + 1))  # two servers saw it
    with pytest.raises(TensorMismatchError, match="workers of machine gpu0 called push_pull with different"):
        check_header(h, 3, None, n_servers=2, machine_names=["gpu0", "gpu1"])


def test_tag_ranges_cannot_overlap():
    names = [r.name for r in p2p.ranges()]
    assert {"sparse-ps", "async-ps", "announce", "pipeline", "partitions"} <= set(names)
    spans = [(r.start, r.start + r.size) for r in p2p.ranges()]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="overlaps 'announce'"):
        p2p.reserve("intruder", 50, 4)
    with pytest.raises(ValueError, match="outside"):
        p2p.ANNOUNCE(8)


def test_flatten_roundtrip():
    ts = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    flat = p2p.flatten(ts)
    back = [torch.zeros_like(t) for t in ts]
    p2p.copy_back(flat, back)
    for a, b in zip(ts, back):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        p2p.unflatten(flat, [(3, 4)])


def _echo(staging, pids, factor=2.0):
    """Stand-in for the servers: the sum of a partition is `factor` × what was sent."""
    for pid in pids:
        sbuf, rbuf = staging.views(pid)
        if sbuf.dtype == torch.uint8:
            rbuf.copy_(sbuf)
        else:
            rbuf.copy_(sbuf * factor)
        staging.stage_in(pid)


def test_host_direct_staging_writes_results_in_place_and_through_copies():
    shapes = [(30, 20), (7,), (600,)]
    ts = [torch.randn(s) for s in shapes]
    ts[0] = ts[0].t()  # not contiguous: goes through a copy, written back in complete()
    orig = [t.clone() for t in ts]
    manifest = Manifest.of([(f"t{i}", t) for i, t in enumerate(ts)])
    lay = FlatLayout.build(manifest, plan_for(np.ones(2), manifest.numel, 1024))
    s = HostDirect(lay)
    s.begin()
    done = []
    for i in reversed(range(len(ts))):  # backward order, and in two ranges for the last tensor
        n = ts[i].numel()
        done += s.fill(i, ts[i], 0, n // 2) + s.fill(i, ts[i], n // 2, n)
    assert sorted(done) == list(range(len(lay.parts)))
    for pid in done:
        s.stage_out(pid)
    _echo(s, s.out_ready(False))
    s.complete(ts)
    for a, b in zip(ts, orig):
        torch.testing.assert_close(a, 2 * b)


def test_host_direct_staging_with_a_codec_keeps_the_error_small():
    t = torch.randn(2000)
    orig = t.clone()
    manifest = Manifest.of([("w", t)])
    lay = FlatLayout.build(manifest, plan_for(np.ones(1), manifest.numel, 2048), ["int8"])
    s = HostDirect(lay)
    s.begin()
    _echo(s, s.fill(0, t, 0, t.numel()))
    s.complete([t])
    assert (t - orig).abs().max() <= orig.abs().max() / 127


def test_host_work_staging_prescales_and_delivers():
    ts = [torch.randn(50), torch.randn(10, 10)]
    orig = [t.clone() for t in ts]
    manifest = Manifest.of([(f"t{i}", t) for i, t in enumerate(ts)])
    lay = FlatLayout.build(manifest, plan_for(np.ones(1), manifest.numel, 1024))
    s = HostWork(lay)
    s.begin(scale=3.0)
    for i, t in enumerate(ts):
        s.fill(i, t, 0, t.numel())
    ready = s.work_ready(False)
    assert sorted(ready) == list(range(len(lay.parts)))
    for pid in ready:
        torch.testing.assert_close(s.work_view(pid), 3.0 * torch.cat([o.reshape(-1) for o in orig])[
            lay.parts[pid].start: lay.parts[pid].start + lay.parts[pid].length])
        s.work_view(pid).add_(1.0)  # what a collective would do to it
        s.deliver(pid)
    s.complete(ts)
    for a, b in zip(ts, orig):
        torch.testing.assert_close(a, 3.0 * b + 1.0)


def _fake_ctx(cluster: dict, mode: str = "byteps"):
    c = parse_cluster(cluster)
    topo = build_topology(c, mode)
    return SimpleNamespace(distributed=True, topology=topo, cluster=c, comm=CommConfig(mode=mode), rank=0,
                           device=torch.device("cpu"), local_groups=("r", "b") if topo.worker_machines[0][1:] else None,
                           local_ranks=tuple(topo.worker_machines[0]), num_workers=len(topo.workers),
                           describe=topo.describe, failed=False, nccl_group=None,
                           peer_error=lambda what, peers, err: RuntimeError(what))


CLUSTER = {"machines": [{"name": "a", "role": "worker", "device": {}, "gpus": 2},
                        {"name": "b", "role": "worker", "device": {}}, {"name": "c", "role": "cpu"}]}


def test_transports_are_chosen_once_from_the_topology():
    assert isinstance(make_transport(_fake_ctx(CLUSTER)), HierarchicalTransport)
    single = {"machines": [{"name": "a", "role": "worker", "device": {}}, {"name": "c", "role": "cpu"}]}
    assert isinstance(make_transport(_fake_ctx(single)), ServerTransport)
    assert isinstance(make_transport(_fake_ctx(CLUSTER, "allreduce")), AllReduceTransport)


@pytest.fixture
def no_gloo(monkeypatch):
    """Fail the test if anything reaches torch.distributed."""
    calls = []
    for name in ("isend", "irecv", "send", "recv", "all_reduce", "reduce", "broadcast", "all_gather"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: calls.append(_n))
    return calls


def test_meta_tensor_raises_before_any_send(no_gloo):
    eng = PushPull(_fake_ctx(CLUSTER))
    with pytest.raises(UserError, match="'b' is on cpu but 'w' is on meta"):
        eng.begin([("b", torch.zeros(3)), ("w", torch.empty(4, device="meta"))], weight=2)
    with pytest.raises(UserError, match="'w' is on meta"):
        eng.push_pull([("w", torch.empty(4, device="meta"))])
    assert no_gloo == [] and not eng.in_flight


def test_the_same_tensor_list_moved_or_reshaped_in_place_is_checked_again(no_gloo):
    """An optimizer hands the engine the same list every step and the engine keeps its
    check of it; a parameter reshaped or re-typed in place (as `model.to()` moves and
    casts `.data`) in the same list is seen and checked again, never sent on the stale check."""
    eng = PushPull(_fake_ctx(CLUSTER))
    w, b = torch.zeros(4), torch.zeros(3)
    named = [("b", b), ("w", w)]
    first = eng._described(named)
    assert eng._described(named) is first  # kept for the same list
    w.data = torch.zeros(5)  # reshaped where it lies
    assert eng._described(named)[1].entries[1].shape == (5,)
    w.data = torch.zeros(5, dtype=torch.int64)  # re-typed where it lies
    with pytest.raises(UserError, match="'w' must be a floating-point"):
        eng.begin(named, weight=2)
    assert no_gloo == [] and not eng.in_flight


def test_guard_keeps_device_memory_away_from_gloo(no_gloo):
    for fn in (p2p.isend, p2p.irecv, p2p.send, p2p.recv):
        with pytest.raises(UserError, match="cannot be handed to gloo"):
            fn(torch.empty(3, device="meta"), 1, p2p.PARTITIONS(0))
    assert no_gloo == []


def test_tensors_on_several_devices_or_not_the_workers_are_refused():
    with pytest.raises(UserError, match="all be on one device: 'a' is on cpu but 'b' is on meta"):
        check_tensors([("a", torch.zeros(2)), ("b", torch.empty(2, device="meta"))], None)
    with pytest.raises(UserError, match="floating-point"):
        check_tensors([("a", torch.zeros(2, dtype=torch.int64))], None)
    assert check_tensors([("a", torch.zeros(2))], torch.device("cpu")) == torch.device("cpu")


class _Done:
    def is_completed(self):
        return True

    def wait(self):
        return True


def test_all_reduce_buckets_launch_in_one_fixed_order(monkeypatch):
    """Buckets are all-reduced as soon as they and every bucket before them (in backward
    order under --overlap) are filled, so all workers issue the same collectives in the
    same order; results go back to the user's tensors."""
    from hetrain.comm.buckets import BucketCaps

    launched = []

    def fake_all_reduce(t, group=None, async_op=False):
        launched.append(t.numel())
        t.mul_(2.0)  # stand-in for the sum over two workers with equal gradients
        return _Done()

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    ctx = _fake_ctx({"machines": [{"name": "a", "role": "worker", "device": {}}]}, "allreduce")
    ctx.comm = CommConfig(mode="allreduce", overlap=True)
    ctx.bucket, ctx.worker_group = None, "workers"
    tr = AllReduceTransport(ctx)
    tr.caps = BucketCaps(2**20, 1024)  # small buckets: several per tensor
    ts = [torch.randn(300), torch.randn(40, 10), torch.randn(500)]
    orig = [t.clone() for t in ts]
    manifest = Manifest.of([(f"t{i}", t) for i, t in enumerate(ts)])
    lay = FlatLayout.build(manifest, tr.partitions(manifest))
    assert len(lay.parts) > 3
    s = HostWork(lay)
    s.begin(scale=0.5)
    tr.begin(s, epoch=1, overlapped=True)
    s.fill(0, ts[0], 0, 300)  # the first tensor alone completes no bucket at the end of the order
    tr.progress()
    assert launched == []
    for i in (2, 1):
        s.fill(i, ts[i], 0, ts[i].numel())
        tr.progress()
    tr.finish()
    s.complete(ts)
    assert launched == [lay.parts[pid].length for pid in lay.order(backward=True)]
    for a, b in zip(ts, orig):
        torch.testing.assert_close(a, b)  # 0.5 (the worker's share) × 2 (the sum)


def test_host_direct_staging_converts_half_precision():
    ts = [torch.randn(100).half(), torch.randn(30)]
    orig = [t.clone() for t in ts]
    manifest = Manifest.of([(f"t{i}", t) for i, t in enumerate(ts)])
    lay = FlatLayout.build(manifest, plan_for(np.ones(1), manifest.numel, 1024))
    s = HostDirect(lay)
    s.begin()
    for i, t in enumerate(ts):
        for pid in s.fill(i, t, 0, t.numel()):
            s.stage_out(pid)
    _echo(s, s.out_ready(False))
    s.complete(ts)
    assert ts[0].dtype == torch.float16
    torch.testing.assert_close(ts[0], 2 * orig[0])
    torch.testing.assert_close(ts[1], 2 * orig[1])


def test_allreduce_buckets_are_the_same_on_gpu_and_cpu_workers():
    """A GPU worker and a CPU worker of one all-reduce job cut the same buckets (gloo aborts
    on collectives of different sizes): the choice comes from the cluster file, not from
    each worker's own device."""
    cluster = {"machines": [{"name": "g", "role": "worker", "device": {"cuda": True}},
                            {"name": "c", "role": "worker", "device": {}}]}
    cuts = []
    for rank, device in ((0, torch.device("cuda", 0)), (1, torch.device("cpu"))):
        ctx = _fake_ctx(cluster, "allreduce")
        ctx.rank, ctx.device, ctx.worker_group = rank, device, "workers"
        manifest = Manifest(tuple(Entry(f"w{i}", (2_000_000,)) for i in range(5)))
        cuts.append([(p.start, p.length) for p in AllReduceTransport(ctx).partitions(manifest)])
    assert cuts[0] == cuts[1] and len(cuts[0]) > 1


@pytest.mark.parametrize("ranged", [False, True])
def test_host_in_place_staging_all_reduces_buckets_where_they_lie_and_through_buffers(ranged):
    """All-reduce buckets over the tensors of a step: several tensors per bucket (packed and
    unpacked in one go), one bucket inside one large tensor (in place), a tensor cut over
    two buckets, a non-contiguous tensor and one that shares storage with an earlier one
    (both through buffers, written back by complete()); `ranged` hands every tensor over
    in two halves. A stand-in all-reduce doubles each bucket; every element must end as
    2 x scale x its value."""
    base = torch.randn(40)
    ts = [torch.randn(50), torch.randn(7), torch.randn(30, 20).t(), base[:20], base[20:], torch.randn(300),
          torch.randn(3)]
    orig = [t.clone() for t in ts]
    manifest = Manifest.of([(f"t{i}", t) for i, t in enumerate(ts)])
    lay = FlatLayout.build(manifest, plan_buckets([t.numel() for t in ts], 60, 200))
    assert any(len(s) > 1 for s in lay.spans) and any(len(s) == 1 for s in lay.spans)
    assert any(len(touch) > 1 for touch in lay.tensor_touches)  # a tensor over two buckets
    s = HostInPlace(lay)
    for step in range(2):  # buffers are reused from one step to the next
        for t, o in zip(ts, orig):
            t.copy_(o)
        s.begin(0.25)
        done = []
        for i in reversed(range(len(ts))):  # backward order
            n = ts[i].numel()
            done += s.fill(i, ts[i], 0, n // 2) + s.fill(i, ts[i], n // 2, n) if ranged else s.fill(i, ts[i], 0, n)
        assert sorted(done) == list(range(len(lay.parts))) and sorted(s.work_ready(False)) == sorted(done)
        for pid in done:
            s.work_view(pid).mul_(2.0)  # the all-reduce of two workers holding the same values
            s.deliver(pid)
        s.complete(ts)
        for t, o in zip(ts, orig):
            torch.testing.assert_close(t, 0.5 * o)


@pytest.mark.parametrize("short", [False, True])
def test_gradient_homes_live_in_the_bucket_and_are_neither_packed_nor_unpacked(short):
    """Gradients pointed at their piece of a bucket buffer (`homes_for`, what the optimizer
    does at zero_grad) are summed where they lie; one replaced by another tensor (set to
    None and re-made by backward) takes the copying path; results are the same. `short`:
    homes are counted in by `arrived` (a hook's short path), which refuses the replaced one."""
    shapes = [(6, 5), (5,), (40,), (3, 4)]
    params = [torch.zeros(s) for s in shapes]
    manifest = Manifest.of([(f"p{i}", p) for i, p in enumerate(params)])
    lay = FlatLayout.build(manifest, plan_buckets([p.numel() for p in params], 36, 60))
    s = HostInPlace(lay)
    homes = s.homes_for(params)
    assert homes and all(homes[i].shape == params[i].shape for i in homes)
    assert s.homes_for(params) is homes  # made once per parameter list
    values = [torch.randn(sh) for sh in shapes]
    for moved in (False, True):
        s.zero_homes()
        grads = {i: homes[i] for i in homes}
        for i, v in enumerate(values):
            if i in grads and not (moved and i == min(grads)):
                grads[i].add_(v)  # backward accumulating into the home
            else:
                grads[i] = v.clone()  # a gradient backward made elsewhere
        s.begin(0.5)
        done = []
        for i in reversed(range(len(shapes))):
            took = s.arrived(i, grads[i]) if short else None
            assert took is None or grads[i] is homes[i]
            assert short and i in homes and grads[i] is homes[i] or took is None
            done += took if took is not None else s.fill(i, grads[i], 0, grads[i].numel())
        assert sorted(done) == list(range(len(lay.parts))) and sorted(s.work_ready(False)) == sorted(done)
        for pid in done:
            s.work_view(pid).mul_(2.0)
            s.deliver(pid)
        s.complete([grads[i] for i in range(len(shapes))])
        for i, v in enumerate(values):
            torch.testing.assert_close(grads[i], v)


class _HomesEngine:
    """An engine stand-in that keeps every gradient of `params` in one flat buffer (what
    `PushPull.grad_homes` gives on a host all-reduce job)."""

    def __init__(self, params):
        self.buffer = torch.zeros(sum(p.numel() for p in params))
        self.views = {i: v.view(p.shape) for i, (v, p) in
                      enumerate(zip(torch.split(self.buffer, [p.numel() for p in params]), params))}
        self.in_flight = False
        self.single_bucket = False

    def grad_homes(self, named):
        return self.views

    def zero_grad_homes(self):
        self.buffer.zero_()

    def mark_step_start(self):
        pass


@pytest.mark.parametrize("own_zero_grad", [False, True])
def test_zero_grad_with_every_gradient_in_its_bucket(own_zero_grad):
    """zero_grad points the gradients at their homes and zeroes them; once they are all
    there, it zeroes the buckets only (the stock zero_grad would set each to None just to
    be pointed back), but an optimizer with a zero_grad of its own always gets it called."""
    import hetrain

    calls = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    model = torch.nn.Linear(3, 2)
    inner = (Counting if own_zero_grad else torch.optim.SGD)(model.parameters(), lr=0.1)
    opt = hetrain.DistributedOptimizer(inner, named_parameters=model.named_parameters(), overlap=False)
    opt.sync, opt.engine = Sync.SYNC, _HomesEngine([p for _, p in opt._named])
    for step in range(3):
        opt.zero_grad()
        for i, (_, p) in enumerate(opt._named):
            assert p.grad is opt.engine.views[i] and not p.grad.any()
        model(torch.randn(4, 3)).sum().backward()  # accumulates into the bucket
        assert opt.engine.buffer.any()
    assert len(calls) == (3 if own_zero_grad else 0)
