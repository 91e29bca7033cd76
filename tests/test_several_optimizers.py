"""Several exchanges in one training step (tests/scripts/several_optimizers.py): two
DistributedOptimizers stepped after one backward, a GAN's alternating optimizers, and a
push_pull of the loss between backward and step(), with and without overlap, against
one process on the same global batches. Before, with overlap the second optimizer's
hooks handed its gradients into the first one's exchange, and a push_pull between
backward and step() was refused."""
import sys

import pytest
import torch

from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
import several_optimizers as case  # noqa: E402


@pytest.mark.parametrize("mode", ["allreduce", "byteps"])
def test_several_exchanges_per_step_match_one_process(launch, tmp_path, mode):
    """All-reduce with DDP's buckets kept: the tuner would settle these small models on
    one bucket, which exchanges at step() and leaves the hooks idle."""
    out = tmp_path / "res"
    extra = ("--buckets", "ddp") if mode == "allreduce" else ()
    rc, log, _ = launch("several_optimizers.py", str(out), cluster=small_cluster(workers=2, cpus=1), mode=mode,
                        timeout=20, extra=extra)
    assert rc == 0, log
    want = case.train()
    for r in range(2):
        got = torch.load(out / f"rank{r}.pt", weights_only=True)
        assert "between this DistributedOptimizer's zero_grad() and backward()" in got.pop("too_early")
        assert got.pop("many_layouts") == [1.5] * 22  # the mean of 1 and 2, for every layout, kept or not
        assert set(got) == {"overlap=True", "overlap=False"}
        for variant, cases in got.items():
            assert set(cases) == set(want)
            for name, weights in want.items():
                for k, w in weights.items():
                    torch.testing.assert_close(cases[name][k], w, rtol=1e-4, atol=1e-5,
                                               msg=f"rank {r} {variant} {name} {k}")
