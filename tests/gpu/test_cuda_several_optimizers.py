"""Several exchanges in one step with CUDA models (tests/scripts/several_optimizers.py
--cuda; skipped where CUDA is missing): two optimizers after one backward, a GAN's
alternating optimizers and a push_pull of the loss switch the engine between tensor lists
at every step, and each switch takes back that list's CUDA stagings (pinned buffers,
copy streams, events) instead of building new ones. The weights must equal one CPU
process's up to float32 rounding of the GPU kernels."""
import sys

import pytest
import torch

from tests.gpu.test_cuda_paths import shared_gpu
from tests.helpers import SCRIPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

sys.path.insert(0, str(SCRIPTS))
import several_optimizers as case  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "byteps"])
def test_cuda_several_exchanges_per_step_match_one_process(launch, tmp_path, mode):
    out = tmp_path / "res"
    extra = ("--buckets", "ddp") if mode == "allreduce" else ()
    rc, log, _ = launch("several_optimizers.py", str(out), "--cuda", cluster=shared_gpu(2), mode=mode,
                        extra=extra, timeout=60, limit=400)
    assert rc == 0, log
    want = case.train()
    for r in range(2):
        got = torch.load(out / f"rank{r}.pt", weights_only=True)
        assert "between this DistributedOptimizer's zero_grad() and backward()" in got.pop("too_early")
        assert got.pop("many_layouts") == [1.5] * 22
        for variant, cases in got.items():
            for name, weights in want.items():
                for k, w in weights.items():
                    torch.testing.assert_close(cases[name][k], w, rtol=1e-4, atol=1e-5,
                                               msg=f"rank {r} {variant} {name} {k}")
