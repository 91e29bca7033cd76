"""CUDA tensors on the data plane (skipped where CUDA is missing).

In-process: the CUDA stagings (pinned buffers, copy streams, codecs on the GPU) against
a stand-in server, and the guard. Through the launcher: several worker processes share
the one GPU (each machine `device.cuda: true`, all on node 0, so the staged gloo path),
and training a CUDA model through every mode (overlap off and on), every codec,
ddp_comm_hook and bounded staleness 0 gives the single-process update with unequal
batch sizes; backward with overlap runs under set_sync_debug_mode("error").
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import SCRIPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

sys.path.insert(0, str(SCRIPTS))
from reference import single_process  # noqa: E402

HPS = Path(__file__).parents[1] / "hps" / "scripts"


def shared_gpu(workers: int = 3, cpus: int = 1) -> dict:
    """Worker machines that all put their process on cuda:0 of this node."""
    return {"name": "gpu", "machines":
            [{"name": f"g{i}", "role": "worker", "device": {"cuda": True}} for i in range(workers)]
            + [{"name": f"c{j}", "role": "cpu"} for j in range(cpus)]}


def _layout(shapes, codecs=None, servers=2, part=4096):
    from hetrain.comm.flatlayout import FlatLayout
    from hetrain.comm.layout import Manifest
    from hetrain.comm.partition import plan_for

    manifest = Manifest.of([(f"t{i}", torch.empty(s)) for i, s in enumerate(shapes)])
    return FlatLayout.build(manifest, plan_for(np.ones(servers), manifest.numel, part), codecs)


def _serve(staging, pids, factor=2.0):
    for pid in pids:
        sbuf, rbuf = staging.views(pid)
        assert sbuf.device.type == "cpu" and rbuf.device.type == "cpu" and sbuf.is_pinned()
        rbuf.copy_(sbuf if sbuf.dtype == torch.uint8 else sbuf * factor)
        staging.stage_in(pid)


def _round_trip(staging, ts):
    """One step through a CUDA staging as the engine drives it: fill in backward order,
    copy out, a server doubles each partition, copy back, write the results into `ts`."""
    staging.begin()
    done = []
    for i in reversed(range(len(ts))):
        done += staging.fill(i, ts[i], 0, ts[i].numel())
    for pid in done:
        staging.stage_out(pid)
    ready = []
    while len(ready) < len(done):
        ready += staging.out_ready(True)
    _serve(staging, ready)
    staging.complete(ts)


@pytest.mark.parametrize("codec", [None, "fp16", "int8", "int4"])
def test_cuda_direct_staging_round_trip(codec):
    from hetrain.comm.cuda import Cuda, CudaDirect

    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = [(64, 33), (5,), (3000,)]
    lay = _layout(shapes, None if codec is None else [codec] * len(shapes))
    ts = [torch.randn(s, device=dev) for s in shapes]
    ts[0] = ts[0].t()  # not contiguous: a copy, written back at the end
    orig = [t.clone() for t in ts]
    s = CudaDirect(lay, Cuda(dev))
    _round_trip(s, ts)
    torch.cuda.synchronize()
    for a, b in zip(ts, orig):
        want = 2 * b if codec is None else b
        tol = 0 if codec is None else b.abs().max().item() / (7 if codec == "int4" else 100)
        assert (a - want).abs().max().item() <= tol + 1e-6, codec
    if codec is not None:  # the residual of error feedback lives on the GPU
        assert s.feedback.residual.device.type == "cuda"


def test_cuda_work_stagings_round_trip():
    from hetrain.comm.cuda import Cuda, CudaWorkDevice, CudaWorkHost

    dev = torch.device("cuda", torch.cuda.current_device())
    lay = _layout([(100,), (20, 30)], servers=1)
    for cls in (CudaWorkHost, CudaWorkDevice):
        ts = [torch.randn(100, device=dev), torch.randn(20, 30, device=dev)]
        orig = [t.clone() for t in ts]
        s = cls(lay, Cuda(dev))
        s.begin(scale=0.5)
        for i, t in enumerate(ts):
            s.fill(i, t, 0, t.numel())
        ready = []
        while len(ready) < len(lay.parts):
            ready += s.work_ready(True)
        for pid in ready:
            v = s.work_view(pid)
            assert v.is_cuda == (cls is CudaWorkDevice)
            v.add_(1.0)  # what a collective would do
            s.deliver(pid)
        s.complete(ts)
        torch.cuda.synchronize()
        for a, b in zip(ts, orig):
            torch.testing.assert_close(a, 0.5 * b + 1.0)


def test_guard_refuses_cuda_tensors_before_gloo(monkeypatch):
    import torch.distributed as dist

    from hetrain.comm import p2p
    from hetrain.comm.layout import check_tensors
    from hetrain.errors import UserError

    calls = []
    monkeypatch.setattr(dist, "isend", lambda *a, **k: calls.append(a))
    with pytest.raises(UserError, match="cannot be handed to gloo"):
        p2p.isend(torch.zeros(4, device="cuda"), 1, p2p.PARTITIONS(0))
    assert calls == []
    with pytest.raises(UserError, match="all be on one device"):
        check_tensors([("a", torch.zeros(2)), ("b", torch.zeros(2, device="cuda"))], torch.device("cuda", 0))
    bound = torch.device("cuda", torch.cuda.current_device())
    other = torch.device("cuda", (bound.index + 1) % max(2, torch.cuda.device_count()))
    with pytest.raises(UserError, match="model on hetrain.device"):  # a CPU model on a GPU worker
        check_tensors([("w", torch.zeros(2))], bound, "DistributedOptimizer: parameter", model=True)
    assert check_tensors([("g", torch.zeros(2))], bound) == torch.device("cpu")  # host tensors may be pushed
    assert check_tensors([("g", torch.zeros(2, device=bound))], torch.device("cpu")) == bound  # torchrun-style
    if other.index < torch.cuda.device_count():
        with pytest.raises(UserError, match=f"is on {other} but this worker is bound to {bound}"):
            check_tensors([("w", torch.zeros(2, device=other))], bound)


def _check_params(out: Path, n: int, suffix: str = "", momentum: float = 0.9) -> None:
    ref = single_process(momentum=momentum)
    for r in range(n):
        got = torch.load(out / f"rank{r}{suffix}.pt")
        for name, want in ref.items():  # CPU reference vs GPU kernels: float32 rounding only
            torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=f"rank {r} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["byteps", "ps", "colocated", "allreduce"])
def test_cuda_training_matches_single_process(launch, tmp_path, mode, overlap):
    out = tmp_path / "params"
    args = ["--cuda"] + (["--sync-debug"] if overlap else [])  # no host sync in backward
    extra = ("--partition-bytes", "2048") + (("--overlap",) if overlap else ())
    rc, log, _ = launch("equiv_train.py", str(out), *args, cluster=shared_gpu(), mode=mode, extra=extra,
                        timeout=60, limit=400)
    assert rc == 0, log
    _check_params(out, 3)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_codecs_encode_on_the_gpu(launch, tmp_path, overlap):
    out = tmp_path / "cp"
    steps = 6
    extra = ("--partition-bytes", "2048", "--codec", "int8", "--codec-rule", "*.bias=fp16",
             "--codec-rule", "layer1.*=int4") + (("--overlap",) if overlap else ())
    rc, log, _ = launch(str(HPS / "codec_pushpull.py"), str(out), str(steps), "--cuda", cluster=shared_gpu(),
                        mode="ps", extra=extra, timeout=60, limit=400)
    assert rc == 0, log
    runs = [torch.load(out / f"rank{r}.pt") for r in range(3)]
    got, want = runs[0]["got"], runs[0]["want"]
    for r in runs[1:]:
        torch.testing.assert_close(r["got"], got, rtol=0, atol=0)
    scale = want.abs().max()
    err = (got - want).abs().max(0).values
    for sl, tol in ((slice(0, 1200), 0.03), (slice(1200, 1240), 0.002), (slice(1240, 1940), 0.3)):
        assert err[sl].max() <= tol * scale
    assert (got.sum(0) - want.sum(0)).abs().max() <= 1.5 * err.max()


@pytest.mark.slow
def test_cuda_ddp_comm_hook_matches_single_process(launch, tmp_path):
    out = tmp_path / "params"
    rc, log, _ = launch("equiv_train.py", str(out), "--ddp", "--cuda", cluster=shared_gpu(2), mode="byteps",
                        extra=("--partition-bytes", "2048"), timeout=60, limit=400)
    assert rc == 0, log
    _check_params(out, 2, "-ddp")


@pytest.mark.slow
def test_cuda_bounded_staleness_zero_matches_single_process(launch, tmp_path):
    """Parameter servers with bound 0 run lock-step SGD on the global batch."""
    out = tmp_path / "params"
    rc, log, _ = launch("equiv_train.py", str(out), "--cuda", "--sgd", cluster=shared_gpu(), mode="ps",
                        extra=("--sync", "stale", "--staleness", "0"), timeout=60, limit=400)
    assert rc == 0, log
    _check_params(out, 3, momentum=0.0)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU)")
@pytest.mark.parametrize("mode", ["allreduce", "byteps"])
def test_nccl_paths_match_single_process(launch, tmp_path, mode):
    """allreduce: NCCL among the workers of one machine with two GPUs; byteps: the
    hierarchical path with an NCCL local group, then the servers."""
    cluster = {"name": "two", "machines": [{"name": "m", "role": "worker", "device": {"cuda": True}, "gpus": 2},
                                           {"name": "c0", "role": "cpu"}]}
    out = tmp_path / "params"
    rc, log, _ = launch("equiv_train.py", str(out), "--cuda", cluster=cluster, mode=mode,
                        extra=("--partition-bytes", "2048", "--overlap"), timeout=60, limit=400)
    assert rc == 0, log
    _check_params(out, 2)


def test_sanitizer_mode_reaches_launched_processes(tmp_path):
    """`pytest -m gpu --cuda-sanitizer` (or TORCH_CUDA_SANITIZER=1): the sanitizer is on in
    this process and in the processes tests start; without it, off in both."""
    import os
    import subprocess

    from torch.cuda import _sanitizer

    on = "TORCH_CUDA_SANITIZER" in os.environ  # torch's own test, at import
    assert _sanitizer.cuda_sanitizer is not None and _sanitizer.cuda_sanitizer.enabled == on
    probe = "import torch, torch.cuda._sanitizer as s; print(s.cuda_sanitizer.enabled)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(on)
