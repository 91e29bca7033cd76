"""A mixed job in mode all-reduce: one worker on the GPU, two emulated CPU workers of
lower speed, BalancedLoader re-planning the shares (tests/hps/scripts/balanced_train.py
--cuda; skipped where CUDA is missing). The GPU worker's buckets take the CUDA staging,
the CPU workers' the in-place host buckets, and the bucket tuner must agree across both;
the loader re-plans in the exchange's wait (`while_waiting`), the tuner times steps from
zero_grad (`mark_step_start`), and with a dynamic tail the GPU worker claims chunks while
the step runs. The update must equal one CPU process's on the same global batches, up to
float32 rounding of the GPU kernels."""
import pytest
import torch

from tests.hps.test_hps_multiprocess import HPS, check_one_process_update

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIXED = {"name": "mixed", "machines": [
    {"name": "g0", "role": "worker", "device": {"cuda": True}},
    {"name": "w1", "role": "worker", "device": {"speed": 0.5}},
    {"name": "w2", "role": "worker", "device": {"speed": 0.25}}]}


@pytest.mark.slow
@pytest.mark.parametrize("strategy,tail", [("unequal", 0.3), ("accumulate", 0.0)])
def test_cuda_and_cpu_workers_balanced_give_one_process_update(launch, tmp_path, strategy, tail):
    out = tmp_path / "params"
    rc, log, _ = launch(str(HPS / "balanced_train.py"), str(out), "--cuda", f"--strategy={strategy}",
                        f"--tail={tail}", cluster=MIXED, mode="allreduce", timeout=90, limit=400)
    assert rc == 0, log
    check_one_process_update(out, strategy, tail, rtol=1e-4, atol=1e-5)
