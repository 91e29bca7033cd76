"""How often a gradient enters the engine in a training step: a DistributedOptimizer in
real processes (tests/scripts/engine_entries.py, all-reduce and BytePS, with and without
overlap) counts the Python calls into comm/engine.py, comm/worker/, comm/staging/,
comm/transports/ and comm/cuda.py per step, for a model of few tensors and one of many
more with the same buckets; what one more gradient adds is at most 4 calls per step.
Counted so before the engine took each gradient in one call (`PushPull.take`): 10 per
gradient with BytePS, 15 with BytePS and overlap, 5 with all-reduce and overlap; now 3,
3 and 2. The training it counts gives one process's weights, so the count is of the
real path."""
import json
import sys

import pytest
import torch

from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
import engine_entries as case  # noqa: E402

MAX_PER_GRADIENT = 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "byteps"])
def test_a_gradient_enters_the_engine_at_most_four_times_per_step(launch, tmp_path, mode):
    out = tmp_path / "res"
    # DDP's buckets throughout: the tuner's trial plans would change the buckets between steps
    extra = ("--buckets", "ddp") if mode == "allreduce" else ()
    rc, log, _ = launch("engine_entries.py", str(out), cluster=small_cluster(workers=2, cpus=1), mode=mode,
                        timeout=30, extra=extra)
    assert rc == 0, log
    for r in range(2):
        counts = json.loads((out / f"rank{r}.json").read_text())
        weights = torch.load(out / f"rank{r}.pt", weights_only=True)
        for overlap in (True, False):
            few, many = counts[f"overlap={overlap}/few"], counts[f"overlap={overlap}/many"]
            what = f"{mode} overlap={overlap} rank {r}"
            assert few["parts"] == many["parts"] > (1 if mode == "allreduce" else 0), (what, few, many)
            assert many["grads"] - few["grads"] == 32, what
            per_gradient = (many["calls"] - few["calls"]) / (many["grads"] - few["grads"]) / many["steps"]
            print(f"{what}: {per_gradient:.2f} calls per gradient per step; per step {few['calls'] / few['steps']:.0f} "
                  f"({few['grads']} gradients), {many['calls'] / many['steps']:.0f} ({many['grads']})")
            assert 0 < per_gradient <= MAX_PER_GRADIENT, (
                f"{what}: {per_gradient:.2f} calls per gradient per step; the many-tensor model's calls: "
                f"{many['by_function']}; the few-tensor model's: {few['by_function']}")
            for name in ("few", "many"):
                want = case.train({"few": 2, "many": 18}[name], overlap, wrap=False)[0].state_dict()
                got = weights[f"overlap={overlap}/{name}"]
                for k, w in want.items():
                    torch.testing.assert_close(got[k], w, rtol=1e-4, atol=1e-6, msg=f"{what} {name} {k}")
