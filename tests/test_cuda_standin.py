"""The engine's CUDA paths on a CPU host, under the CUDA stand-in and its race checker
(tests/cudastandin/standin.py): the stagings in-process (the GPU suite's own in-process
tests, run unchanged), deliberate removals of one synchronisation that the checker must
catch, and one launched job through every transport, codec, overlap on and off and the
DDP hook, compared with the single-process reference."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.cudastandin import standin
from tests.helpers import SCRIPTS, repo_env

ROOT = Path(__file__).parents[1]
STANDIN = Path(__file__).parent / "cudastandin"


@pytest.fixture
def cuda_standin():
    chk = standin.install(2)
    try:
        yield chk
    finally:
        races = standin.uninstall()
    assert races == [], "\n".join(races)


@pytest.fixture
def gpu_tests(cuda_standin):
    import tests.gpu.test_cuda_paths as gpu

    return gpu


def standin_env(gpus: int = 2, **extra) -> dict:
    """The environment of processes that install the stand-in at start."""
    return repo_env(STANDIN, **{standin.ENV: str(gpus)}, **extra)


# ---- the stand-in itself ----------------------------------------------------------------
def test_standin_device_tensors_are_cuda_to_python_and_host_bytes_to_gloo(cuda_standin):
    from hetrain.comm import p2p
    from hetrain.errors import UserError

    a = torch.randn(6, device="cuda")
    b = torch.ones(6).to("cuda:1")
    assert a.is_cuda and a.device == torch.device("cuda", 0) and b.device == torch.device("cuda", 1)
    assert (a + 1).is_cuda and a[2:].is_cuda and a.view(2, 3).is_cuda
    assert a.cpu().device.type == "cpu" and not a.cpu().is_cuda
    assert torch.empty(3, pin_memory=True).is_pinned() and not torch.empty(3).is_pinned()
    m = torch.nn.Linear(3, 2).cuda()
    m(torch.randn(4, 3, device="cuda")).sum().backward()
    assert m.weight.is_cuda and m.weight.grad.is_cuda
    with pytest.raises(UserError, match="cannot be handed to gloo"):
        p2p.host_only(a, "sending")
    assert torch.cuda.is_available() and torch.cuda.device_count() == 2


def test_checker_names_both_accesses_of_a_race(cuda_standin):
    side = torch.cuda.Stream()
    dev = torch.randn(64, device="cuda")
    host = torch.empty(64, pin_memory=True)
    with torch.cuda.stream(side):  # reads `dev` on the side stream: not ordered after its write
        with pytest.raises(standin.CudaRaceError, match=r"read on stream .* by aten::copy_ .*test_cuda_standin.py"
                                                         r".* not ordered after the write on default stream"):
            host.copy_(dev, non_blocking=True)
    cuda_standin.races.clear()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    with pytest.raises(standin.CudaRaceError, match="write on host by aten::add_"):
        host.add_(1)  # the host has not waited for the copy
    cuda_standin.races.clear()
    done.synchronize()
    host.add_(1)
    torch.testing.assert_close(host, dev.cpu() + 1)


# ---- the GPU suite's in-process tests, unchanged, on the stand-in ------------------------
@pytest.mark.parametrize("codec", [None, "fp16", "int8", "int4"])
def test_cuda_direct_staging_under_the_checker(gpu_tests, codec):
    gpu_tests.test_cuda_direct_staging_round_trip(codec)


def test_cuda_work_stagings_under_the_checker(gpu_tests):
    gpu_tests.test_cuda_work_stagings_round_trip()


def test_guard_under_the_checker(gpu_tests, monkeypatch):
    gpu_tests.test_guard_refuses_cuda_tensors_before_gloo(monkeypatch)


@pytest.mark.parametrize("kind", ["CudaWorkHost", "CudaWorkDevice"])
def test_work_stagings_server_leg_with_codecs_under_the_checker(gpu_tests, kind):
    """The work stagings' server leg with codecs (a machine's owner encoding its local sum:
    on the host for the gloo path, on the GPU for the NCCL one), round trip to a stand-in
    server that echoes the payload, then the results on the compute stream."""
    from hetrain.comm import cuda

    lay = gpu_tests._layout([(300,), (20, 30)], ["int8", "fp16"], servers=1, part=512)
    c = cuda.Cuda(torch.device("cuda", 0))
    s = cuda.CudaWorkDevice(lay, c, server_leg=True) if kind == "CudaWorkDevice" else cuda.CudaWorkHost(lay, c)
    ts = [torch.randn(300, device="cuda"), torch.randn(20, 30, device="cuda")]
    orig = [t.clone() for t in ts]
    s.begin(scale=0.5)
    for i, t in enumerate(ts):
        s.fill(i, t, 0, t.numel())
    ready = []
    while len(ready) < len(lay.parts):
        ready += s.work_ready(True)
    for pid in ready:  # one worker: its local reduce is the identity
        s.stage_out(pid)
    out = []
    while len(out) < len(ready):
        out += s.out_ready(True)
    for pid in out:
        sbuf, rbuf = s.views(pid)
        assert sbuf.device.type == "cpu" and sbuf.dtype == torch.uint8
        rbuf.copy_(sbuf)
        s.stage_in(pid)
        ev = s.in_event(pid)
        if ev is not None:  # what the transport's broadcast waits for
            torch.cuda.current_stream().wait_event(ev)
        s.deliver(pid)
    s.complete(ts)
    for a, b in zip(ts, orig):
        assert (a - 0.5 * b).abs().max().item() <= 0.02 * b.abs().max().item()


# ---- removing one synchronisation makes the checker fire ---------------------------------
def _direct_round_trip_then_use(gpu_tests):
    """The direct staging's round trip, then the optimizer's use of the results on the
    compute stream."""
    from hetrain.comm.cuda import Cuda, CudaDirect

    lay = gpu_tests._layout([(300,), (20, 30)])
    ts = [torch.randn(300, device="cuda"), torch.randn(20, 30, device="cuda")]
    s = CudaDirect(lay, Cuda(torch.device("cuda", 0)))
    gpu_tests._round_trip(s, ts)
    return [t * 1.0 for t in ts]  # on the compute stream


def _no_wait_for_the_gradient(monkeypatch):
    from hetrain.comm import cuda

    monkeypatch.setattr(cuda.Cuda, "mark", lambda self: torch.cuda.Event())  # never recorded: waits for nothing


def _no_host_wait_for_the_copy(monkeypatch):
    from hetrain.comm import cuda

    monkeypatch.setattr(cuda.Cuda, "done", lambda self, ev, wait, what: True)


def _no_compute_wait_for_the_results(monkeypatch):
    from hetrain.comm import cuda

    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", lambda self, other: None)
    assert cuda  # the staging's complete() calls compute().wait_stream(h2d)


@pytest.mark.parametrize("remove, first, second", [
    (_no_wait_for_the_gradient, "after the write on default stream", r"read on stream \d+ by .* at hetrain/comm/cuda.py"),
    (_no_host_wait_for_the_copy, r"after the write on stream \d+ by .* at hetrain/comm/cuda.py",
     "on host by .* at tests/gpu/test_cuda_paths.py"),
    (_no_compute_wait_for_the_results, r"after the write on stream \d+ by .* at hetrain/comm/cuda.py",
     "read on default stream .* at tests/test_cuda_standin.py"),
])
def test_removing_a_synchronisation_is_caught(gpu_tests, cuda_standin, monkeypatch, remove, first, second):
    remove(monkeypatch)
    cuda_standin.raise_on_race = False
    _direct_round_trip_then_use(gpu_tests)
    races = list(cuda_standin.races)
    cuda_standin.races.clear()
    assert races, "the checker missed the removed synchronisation"
    import re

    assert any(re.search(second, r) and re.search(first, r) for r in races), "\n".join(races)


# ---- one launched job: every transport, codec, overlap on/off, the DDP hook ---------------
def test_every_cuda_path_in_one_launched_job_matches_the_reference(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    from reference import single_process

    cluster = {"name": "standin", "machines": [
        {"name": "m", "role": "worker", "device": {"cuda": True}, "gpus": 2},
        {"name": "g", "role": "worker", "device": {"cuda": True}},
        {"name": "c0", "role": "cpu"}]}
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(cluster))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hetrain.cli", "launch", "--cluster", str(cfile), "--mode", "ps", "--timeout", "60",
           "--run-dir", str(tmp_path / "run"), "--partition-bytes", "2048", "--codec-rule", "cfp16.*=fp16",
           "--codec-rule", "cint8.*=int8", "--codec-rule", "cint4.*=int4", str(SCRIPTS / "standin_job.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=standin_env(2), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CUDA stream race" not in proc.stdout + proc.stderr
    ref = single_process()
    tol = {"cfp16": 2e-3, "cint8": 3e-2, "cint4": 0.3}
    seen = set()
    saved = [torch.load(out / f"rank{r}.pt") for r in range(3)]
    # machine m's two workers issue their NCCL collectives (reduce and broadcast communicators,
    # and the pair's all-reduce) in one global order
    assert saved[0]["nccl"] and saved[0]["nccl"] == saved[1]["nccl"]
    # NCCL groups are bound to the worker's GPU when made (eager communicators), NCCL's sockets
    # use the interface of the machine's address, and waits are not forced to block the host
    for r in range(3):
        assert saved[r]["nccl_devices"] == [torch.device("cuda", min(r, 1) if r < 2 else 0)] * 3
        assert saved[r]["env"] == {"NCCL_SOCKET_IFNAME": "=lo", "TORCH_NCCL_BLOCKING_WAIT": None}
    for r in range(3):
        for key, (got, want) in saved[r]["exchanges"].items():
            rel = tol.get(key.split(".")[1], 0.0)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 + rel * want.abs().max().item(),
                                       msg=f"rank {r} {key}")
            seen.add(key)
        for kind, params in saved[r]["trained"].items():
            for name, want in ref.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {kind} {name}")
    assert {"pair.cuda.overlap", "mixed.cuda.plain", "pair.cuda.speculated", "mixed.cuda.speculated", "pair.host.plain", "job.cint4.plain", "job.host.overlap",
            "job.plain.overlap"} <= seen


def test_gpu_suite_compares_with_the_reference_of_its_momentum(gpu_tests, tmp_path):
    """The launched GPU tests' reference check passes the momentum as the momentum (not as
    the list of batches)."""
    sys.path.insert(0, str(SCRIPTS))
    from reference import single_process

    for momentum in (0.9, 0.0):
        torch.save(single_process(momentum=momentum), tmp_path / "rank0.pt")
        gpu_tests._check_params(tmp_path, 1, momentum=momentum)


def test_a_gpu_loader_reserves_the_engine_buffers(cuda_standin):
    """On a GPU, the balanced loader reserves hetrain's own push_pull buffers (the stagings'
    work buffer) with the model's state before samples get memory."""
    from hetrain.train.loader import BalancedLoader

    model = torch.nn.Linear(10, 4).cuda()
    numel = sum(p.numel() for p in model.parameters())
    data = (torch.randn(32, 10), torch.randint(0, 4, (32,)))
    loader = BalancedLoader(data, 8, model=model, device="cuda:0", memory_per_sample=1.0)
    assert loader.batches.balancer.cfg.reserved_bytes == 2 * 4 * numel + 4 * numel
