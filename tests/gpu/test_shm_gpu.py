"""The shared-memory host group's CUDA strategy on a real GPU (skipped where CUDA is
missing): a process with a CUDA tensor and one with a host tensor all-reduce through
segments registered with cudaHostRegister; the sums equal the host sum, fp32 and fp16,
over several rounds of a segment."""
import multiprocessing as mp
import os
import uuid

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SECRET = "0123456789abcdef0123456789abcdef"


def _member(rank: int, path: str, job: str, out) -> None:
    import torch.distributed as dist

    from hetrain.comm.shm.cuda import CudaHostGroup
    from hetrain.comm.shm.group import HostGroup

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    kw = dict(job_id=job, secret=SECRET, key="g", ranks=[0, 1], rank=rank, barrier=dist.barrier,
              capacity=1 << 20, timeout_s=60)
    gpu = rank == 0
    group = CudaHostGroup(device=torch.device("cuda", 0), **kw) if gpu else HostGroup(**kw)
    result = "ok"
    try:
        for dtype in (torch.float32, torch.float16):
            for numel in (5, 300_001):
                base = torch.arange(numel, dtype=torch.float32) % 1000
                want = (base * 1 + base * 2).to(dtype)
                mine = (base * (rank + 1)).to(dtype)
                if gpu:
                    x = mine.cuda() * 1  # produced on the compute stream
                    group.start(x).wait()
                    got = x.cpu()
                else:
                    group.start(mine).wait()
                    got = mine
                tol = dict(rtol=1e-6, atol=0) if dtype == torch.float32 else dict(rtol=2e-3, atol=1.0)
                torch.testing.assert_close(got.float(), want.float(), **tol)
        if gpu:
            result += f" pinned {len(group._pinned)} of {len(group.segments)}"
    except (AssertionError, RuntimeError) as err:
        result = f"{type(err).__name__}: {err}"
    group.close()
    out.put((rank, result))
    out.close()
    out.join_thread()
    os._exit(0)


def test_cuda_tensor_all_reduces_through_pinned_segments(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    job = f"t{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_member, args=(r, str(tmp_path / "pg"), job, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(10)
    assert res[0].startswith("ok") and res[1] == "ok", res
