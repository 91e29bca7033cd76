"""The shared-memory host group's CUDA strategy (hetrain/comm/shm/cuda.py) under the CUDA
stand-in and its race checker (tests/cudastandin/): a GPU process and a CPU process of
one host all-reduce, the GPU's buckets copied straight into its pinned segment and the
sums straight back; results equal the host sum and the checker sees no race. Without the
host's wait for the copy into the segment, the checker reports the race."""
import multiprocessing as mp
import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.cudastandin import standin

STANDIN = Path(__file__).parent / "cudastandin"
ROOT = Path(__file__).parents[1]
SECRET = "0123456789abcdef0123456789abcdef"


def _member(rank: int, path: str, job: str, drop_sync: bool, out) -> None:
    from hetrain.comm.shm.cuda import CudaHostGroup
    from hetrain.comm.shm.group import HostGroup

    assert torch.cuda.is_available()  # the stand-in, installed at interpreter start
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    kw = dict(job_id=job, secret=SECRET, key="g", ranks=[0, 1], rank=rank, barrier=dist.barrier,
              capacity=1 << 20, timeout_s=30)
    gpu = rank == 0
    group = CudaHostGroup(device=torch.device("cuda", 0), **kw) if gpu else HostGroup(**kw)
    if drop_sync:
        group._sync = lambda: None
    result = "ok"
    try:
        for dtype in (torch.float32, torch.float16):
            for numel in (5, 300_001):  # 300k fp32: two rounds of a 1 MiB segment
                want = sum((torch.arange(numel, dtype=torch.float32) % 1000) * (r + 1) for r in range(2))
                mine = ((torch.arange(numel, dtype=torch.float32) % 1000) * (rank + 1)).to(dtype)
                if gpu:  # made on the compute stream, handed over as a bucket is
                    x = mine.to("cuda") * 1
                    group.start(x).wait()
                    got = (x * 1).cpu()  # read back on the compute stream, after the wait
                else:
                    got = group.start(mine).wait() and mine
                tol = dict(rtol=1e-6, atol=0) if dtype == torch.float32 else dict(rtol=2e-3, atol=1.0)
                torch.testing.assert_close(got.float(), want.to(dtype).float(), **tol)
    except (AssertionError, RuntimeError) as err:  # a race (AssertionError), or a peer that left
        result = f"{type(err).__name__}: {err}"
    races = standin.uninstall() if gpu else []
    out.put((rank, result, races))
    out.close()
    out.join_thread()
    os._exit(0)  # a member may have failed mid-round: no gloo teardown


def _run(tmp_path, monkeypatch, drop_sync: bool) -> dict:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN), str(ROOT)]))
    monkeypatch.setenv(standin.ENV, "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    job = f"t{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_member, args=(r, str(tmp_path / "pg"), job, drop_sync and r == 0, q))
             for r in range(2)]
    for p in procs:
        p.start()
    res = {}
    try:
        for _ in range(2):
            try:
                rank, result, races = q.get(timeout=180 if not res else 30)
            except Exception:  # a member that failed without a result (its peer left)
                break
            res[rank] = (result, races)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return res


@pytest.mark.slow
def test_cuda_buckets_go_straight_into_pinned_segments_without_races(tmp_path, monkeypatch):
    res = _run(tmp_path, monkeypatch, drop_sync=False)
    assert res[0] == ("ok", []) and res[1] == ("ok", []), res


@pytest.mark.slow
def test_the_race_checker_sees_a_missing_wait_for_the_copy(tmp_path, monkeypatch):
    res = _run(tmp_path, monkeypatch, drop_sync=True)
    result, _ = res[0]
    assert result.startswith("CudaRaceError"), result
