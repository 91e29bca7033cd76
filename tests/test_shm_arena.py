"""Buckets that live in shared memory (hetrain/comm/shm/arena.py) with real spawned
processes: results equal gloo's all-reduce and one process's sum (sum and average, odd
sizes, a bucket with a trailer's room), every member holds the same bits, the reduce to
an owner and the broadcast from it give the owner's sum, a caller that writes its
bucket as soon as a round returns never changes a peer's result, and misuse is refused
with a message (a SIGKILLed member: tests/test_shm_group.py, both kinds of group)."""
import uuid

import pytest
import torch
import torch.distributed as dist

from hetrain.comm.shm.arena import ArenaGroup, arena_bytes
from hetrain.errors import UserError
from hetrain.runtime.shmnames import job_segments
from tests.shm_procs import SECRET, init, run_all

SIZES = (1, 7, 1000, 300_001)


def _inputs(rank: int, numel: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel + 7919 * salt)
    return torch.randn(numel, generator=g)


def _arena(rank: int, n: int, job: str, lengths) -> ArenaGroup:
    return ArenaGroup(job_id=job, secret=SECRET, key="a", ranks=list(range(n)), rank=rank, barrier=dist.barrier,
                      capacity=arena_bytes(list(lengths)), timeout_s=30)


def _equal_member(rank: int, n: int, path: str, job: str) -> None:
    init(rank, n, path)
    lengths = [m for m in SIZES for _ in (False, True)]
    g = _arena(rank, n, job, lengths)
    dist.barrier()
    assert job_segments(job) == [], "names stay in /dev/shm after every member mapped them"
    bufs = [g.alloc(m) for m in lengths]
    assert len({b.data_ptr() % 64 for b in bufs}) == 1, "buckets start on cache lines"
    for rounds in range(3):  # the same buckets, step after step
        for k, (buf, average) in enumerate(zip(bufs, [False, True] * len(SIZES))):
            m = buf.numel()
            buf.copy_(_inputs(rank, m, rounds))
            ref = buf.clone()
            dist.all_reduce(ref)  # gloo
            one = sum(_inputs(r, m, rounds).double() for r in range(n))
            if average:
                ref, one = ref / n, one / n
            (g.start(buf, average=average).wait() if k % 2 else g.all_reduce(buf, average=average))
            got = buf.clone()
            buf.fill_(float("nan"))  # the caller writes its bucket at once: no peer may see it
            what = f"round {rounds} numel {m} average {average}"
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=what)
            torch.testing.assert_close(got.double(), one, rtol=1e-5, atol=1e-5, msg=what)
            every = [torch.empty_like(got) for _ in range(n)]
            dist.all_gather(every, got)
            assert all(torch.equal(e, every[0]) for e in every), f"members differ: {what}"
    for k, buf in enumerate(bufs):  # the in-host reduce to an owner and the broadcast from it
        m, root = buf.numel(), k % n
        buf.copy_(_inputs(rank, m, 7))
        want = sum(_inputs(r, m, 7).double() for r in range(n)).float()
        g.submit(g.reduce, buf, root, "reducing").wait()
        if rank == root:
            torch.testing.assert_close(buf, want, rtol=1e-5, atol=1e-5)
            buf.mul_(-1.0)  # the owner's result changes (the servers' sum) before the broadcast
        g.broadcast(buf, root)
        got = buf.clone()
        buf.fill_(float("nan"))  # written at once: the owner may not see it, nor a peer still copying
        torch.testing.assert_close(got, -want, rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="allocated from it"):
        g.all_reduce(torch.ones(3))
    with pytest.raises(UserError, match="no room"):
        g.alloc(1)
    g.close()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.long), 4])
def test_buckets_in_the_segments_equal_gloo_and_one_process(n, tmp_path):
    job = f"t{uuid.uuid4().hex[:8]}"
    assert run_all(_equal_member, n, str(tmp_path / "pg"), job) == [0] * n
    assert job_segments(job) == []


def test_arena_bytes_align_every_bucket():
    assert arena_bytes([1]) == 64
    assert arena_bytes([16, 17]) == 64 + 128
    assert arena_bytes([]) == 0


def test_an_exchange_sets_engine_keeps_no_buckets_of_its_own():
    """A worker switches among the engines of its exchange sets: none holds a copy of the
    gradients in shared memory (no agreement needed: every member knows its group)."""
    from hetrain.comm.group import Group
    from hetrain.comm.transports.collective import ShmCollective

    members = Group("exchange 0,1", (0, 1), keeps_buckets=False)
    assert ShmCollective(None, members, cuda=False).arena_for(object(), True, [10]) is None
