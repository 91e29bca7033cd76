"""The HeterPS runtime on a real GPU (skipped where CUDA is missing).

Through the launcher, `--devices real`: dense stages on the GPU (two replicas sharing
it: their push_pull all-reduces over gloo from pinned buffers), sparse stages on CPU
workers with the sparse PS, activations and gradients crossing CPU<->GPU through pinned
host memory; the trained model equals the single-process reference. Also: a stage with
its embedding lookups on the GPU (rows pulled from the CPU shards), a GPU too small for
its stage refused before training, and the pinned staging in-process.
"""
import json

import pytest
import torch

from hetrain.pipeline.spec import RunSpec
from tests.heterps.helpers import make_plan, train
from tests.heterps.test_pipeline import _compare

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARGS = ("--steps", "3", "--micro-batches", "8", "--optimizer", "sgd", "--lr", "0.5", "--devices", "real", "--quiet")


@pytest.mark.parametrize("stages, on_gpu", [
    # sparse stage (bottom MLP + every table) on 2 CPU workers, dense stage (interaction + top MLP) on the GPU x2
    ([((0, 10), "cpu", "cpu", 2), ((10, 14), "gpu-k80", "gpu", 2)], [False, True]),
    # lookups on the GPU: rows pulled from the CPU shards go up, their gradients come down
    ([((0, 6), "gpu-k80", "gpu", 1), ((6, 14), "cpu", "cpu", 2)], [True, False]),
])
def test_gpu_and_cpu_stages_equal_one_process(tmp_path, stages, on_gpu):
    rc, out, run = train(tmp_path, make_plan(stages, batch=251), *ARGS, "--json", str(tmp_path / "r.json"), limit=300)
    assert rc == 0, out
    res = json.loads((tmp_path / "r.json").read_text())
    assert [s["device"] == "cuda" for s in res["stages"]] == on_gpu and not res["emulated"]
    metrics = [json.loads(p.read_text()) for p in (run / "metrics").glob("rank*.json")]
    devices = {m["role"].split("/")[0]: m["device"] for m in metrics if m["role"].startswith("stage")}
    assert [devices[f"stage{s}"].startswith("cuda") for s in range(len(stages))] == on_gpu
    spec = RunSpec.load(run / "spec.json")
    _compare(spec, 3, rtol=1e-4, atol=1e-5)  # GPU kernels add in another order than the CPU's


def test_gpu_too_small_for_its_stage_is_refused_before_training(tmp_path):
    # 10^9 samples, the largest batch a plan may name: the dense stage's stored activations
    # alone need about 555 GiB, more than any one GPU has
    plan = make_plan([((0, 10), "cpu", "cpu", 1), ((10, 14), "gpu-k80", "gpu", 1)], batch=10**9)
    rc, out, _ = train(tmp_path, plan, "--steps", "2", "--micro-batches", "8", "--devices", "real",
                       "--timeout", "10", limit=200)
    assert rc != 0, out
    assert "the stages placed on GPU cuda:0 of machine s1r0 need about" in out and "GiB free" in out, out
    assert "lost rank 1 (worker on machine s1r0)" in out, out  # the others name it


def test_pinned_staging_round_trip():
    from hetrain.pipeline.cuda_wire import CudaWire

    wire = CudaWire(torch.device("cuda", torch.cuda.current_device()))
    dev = [torch.randn(1000, device=wire.device), torch.arange(7, device=wire.device)]
    host = wire.to_host(dev)
    assert all(h.device.type == "cpu" and h.is_pinned() for h in host)
    assert torch.equal(host[0], dev[0].cpu()) and torch.equal(host[1], dev[1].cpu())
    buf = wire.host_buffer(1000, torch.float32)
    buf.copy_(host[0] * 2)
    back = wire.to_device(buf)
    assert back.device == wire.device and torch.equal(back, dev[0] * 2)
    assert torch.equal(wire.from_cpu(torch.ones(3)), torch.ones(3, device=wire.device))
