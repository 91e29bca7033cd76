"""The shared-memory host group (hetrain/comm/shm/) with real spawned processes: results
equal gloo's all-reduce and one process's sum (sum and average, fp32 and fp16, odd sizes,
rounds larger than a segment), every member holds the same bits, and the reduce to one
member and the broadcast from one equal theirs; a SIGKILLed member is
named at once and no segment is left in /dev/shm; without the job secret nothing attaches."""
import multiprocessing as mp
import os
import signal
import stat
import uuid

import pytest
import torch
import torch.distributed as dist

from hetrain.comm.shm.group import HostGroup
from hetrain.comm.shm.segment import Segment, SegmentAuthError
from hetrain.runtime.shmnames import job_segments, remove_job_segments, segment_name
from tests.shm_procs import SECRET, init, killed_member, run_all, spawn

CAPACITY = 1 << 20  # small: a 300k-element fp32 tensor takes two rounds
SIZES = (1, 7, 1000, 300_001)


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g).to(dtype)


def _group(rank: int, n: int, job: str, key: str = "g") -> HostGroup:
    return HostGroup(job, SECRET, key, list(range(n)), rank, dist.barrier, capacity=CAPACITY, timeout_s=30)


def _equal_member(rank: int, n: int, path: str, job: str) -> None:
    init(rank, n, path)
    g = _group(rank, n, job)
    dist.barrier()  # every member has unlinked its name
    assert job_segments(job) == [], "names stay in /dev/shm after every member mapped them"
    for dtype in (torch.float32, torch.float16):
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3 * n)
        for numel in SIZES:
            for average in (False, True):
                x = _inputs(rank, numel, dtype)
                ref = x.clone()
                dist.all_reduce(ref)  # gloo
                if average:
                    ref = (ref.float() / n).to(dtype)
                one = sum(_inputs(r, numel, dtype).double() for r in range(n))  # one process's sum
                one = one / n if average else one
                got = x.clone()
                (g.start(got, average=average).wait() if numel % 2 else g.all_reduce(got, average=average))
                what = f"{dtype} numel {numel} average {average}"
                torch.testing.assert_close(got.float(), ref.float(), **tol, msg=what)
                torch.testing.assert_close(got.double(), one.to(dtype).double(), **tol, msg=what)
                every = [torch.empty_like(got) for _ in range(n)]
                dist.all_gather(every, got)
                assert all(torch.equal(e, every[0]) for e in every), f"members differ: {what}"
    for numel in SIZES:  # the in-host reduce to an owner and the broadcast from it (hierarchical)
        root = numel % n
        x = _inputs(rank, numel, torch.float32)
        want = sum(_inputs(r, numel, torch.float32).double() for r in range(n)).float()
        g.submit(g.reduce, x, root, "reducing").wait()
        if rank == root:
            torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
        y = _inputs(rank, numel, torch.float32)
        g.broadcast(y, root)
        assert torch.equal(y, _inputs(root, numel, torch.float32))
    g.close()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4])
def test_results_equal_gloo_and_one_process(n, tmp_path):
    job = f"t{uuid.uuid4().hex[:8]}"
    assert run_all(_equal_member, n, str(tmp_path / "pg"), job) == [0] * n
    assert job_segments(job) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rounds", "arena"])
def test_killed_peer_is_named_within_the_heartbeat_time_and_leaves_no_segment(kind, tmp_path):
    """Over a host group's rounds and over buckets in the segments (comm/shm/arena.py)."""
    from hetrain.runtime.heartbeat import INTERVAL_S, SAMPLE_S

    n, job = 3, f"t{uuid.uuid4().hex[:8]}"
    out = mp.get_context("spawn").Queue()
    procs = spawn(killed_member, n, str(tmp_path / "pg"), job, kind, out)
    got = sorted(out.get(timeout=120) for _ in range(n - 1))
    for p in procs:
        p.join(60)
    assert procs[-1].exitcode == -signal.SIGKILL
    for rank, message, waited, ranks in got:
        assert ranks == [n - 1], message
        assert f"rank {n - 1} ended" in message
        assert waited < INTERVAL_S + SAMPLE_S, f"rank {rank} took {waited:.1f} s to name the dead peer"
    assert job_segments(job) == []


def test_without_the_job_secret_nothing_attaches():
    job = f"t{uuid.uuid4().hex[:8]}"
    name = segment_name(job, SECRET, "g-0")
    assert job in name and name != segment_name(job, "another secret of the same length!", "g-0")
    seg = Segment.create(name, SECRET, CAPACITY)
    try:
        assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
        with pytest.raises(SegmentAuthError, match="does not carry this job's token"):
            Segment.attach(name, "not the secret, not the secret!!")
        peer = Segment.attach(name, SECRET)  # with the secret: the same memory
        seg.view(torch.float32, 4).copy_(torch.arange(4.0))
        assert torch.equal(peer.view(torch.float32, 4), torch.arange(4.0))
        peer.close()
    finally:
        seg.close()
    assert job_segments(job) == []


def _make_and_die(job: str) -> None:
    Segment.create(segment_name(job, SECRET, "g-0"), SECRET, CAPACITY)
    os.kill(os.getpid(), signal.SIGKILL)  # before any peer mapped it: the name stays


def test_the_launcher_removes_what_a_killed_process_left():
    job = f"t{uuid.uuid4().hex[:8]}"
    p = mp.get_context("spawn").Process(target=_make_and_die, args=(job,))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert len(job_segments(job)) == 1
    assert remove_job_segments(job) == 1
    assert job_segments(job) == []


def _no_room_member(rank: int, n: int, path: str, out) -> None:
    import warnings
    from types import SimpleNamespace

    from hetrain.comm.group import Group
    from hetrain.comm.shm import select
    from hetrain.comm.transports.collective import ShmCollective

    init(rank, n, path)
    select._capacity = lambda members: 0  # /dev/shm without room, as every member finds it
    select._room = lambda members: 0
    ctx = SimpleNamespace(env=SimpleNamespace(restart=0, job_id="noroom", origin="hetrain"), rank=rank,
                          comm=SimpleNamespace(op_timeout_s=60.0), device=torch.device("cpu"))
    coll = ShmCollective(ctx, Group("workers", tuple(range(n)), dist.group.WORLD), cuda=False)
    layout = SimpleNamespace(parts=[SimpleNamespace(length=1001)])
    assert coll.arena_for(layout, True, [1001]) is None  # no room for buckets in the segments either
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        coll.begin(None, SimpleNamespace(on_device=False))
    x = torch.full((1001,), float(rank + 1))
    coll.start(0, x, x, "all-reducing").wait()
    out.put((rank, coll.host is None and coll.fallback is not None, x[0].item(),
             any("gloo carries it" in str(w.message) for w in seen)))
    dist.destroy_process_group()


def test_without_room_in_dev_shm_host_buffers_keep_gloo(tmp_path):
    n = 2
    q = mp.get_context("spawn").Queue()
    procs = spawn(_no_room_member, n, str(tmp_path / "pg"), q)
    got = sorted(q.get(timeout=120) for _ in range(n))
    for p in procs:
        p.join(30)
    assert got == [(0, True, 3.0, True), (1, True, 3.0, True)]
