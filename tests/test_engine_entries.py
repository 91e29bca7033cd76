"""How often a gradient enters the engine in a training step: a DistributedOptimizer in
real processes (tests/scripts/engine_entries.py, with and without overlap) counts the
Python calls into comm/engine.py, comm/worker/, comm/staging/, comm/transports/ and
comm/cuda.py per step, for a model of few tensors and one of many more with the same
buckets; what one more gradient adds is at most 4 calls per step. Three transports:
all-reduce, BytePS (a worker per machine), and the hierarchical one (a machine of two
workers reducing locally before its owner pushes, which polls its reduces in flight).
Counted so before the engine took each gradient in one call (`PushPull.take`): 10 per
gradient with BytePS, 15 with BytePS and overlap, 5 with all-reduce and overlap; now 3,
3 and 2. The hierarchical transport counted 8 before its passes were limited to what can
have moved and its polls to one per interval; now 2.9 to 3.6. The training it counts gives
one process's weights, so the count is of the real path."""
import json
import sys

import pytest
import torch

from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
import engine_entries as case  # noqa: E402

# machine a: two emulated GPUs (two workers: the hierarchical transport), machine b: one
HIERARCHICAL = {"name": "hier", "machines": [
    {"name": "a", "role": "worker", "device": {"speed": 1.0}, "gpus": 2},
    {"name": "b", "role": "worker", "device": {"speed": 0.5}},
    {"name": "c0", "role": "cpu"}]}
# case -> (cluster, mode, extra launch arguments, the transport of ranks 0 and 1)
CASES = {
    # DDP's buckets throughout: the tuner's trial plans would change the buckets between steps
    "allreduce": (small_cluster(workers=2, cpus=1), "allreduce", ("--buckets", "ddp"), "AllReduceTransport"),
    "byteps": (small_cluster(workers=2, cpus=1), "byteps", (), "ServerTransport"),
    "hierarchical": (HIERARCHICAL, "byteps", (), "HierarchicalTransport"),
}
MAX_PER_GRADIENT = 4


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_gradient_enters_the_engine_at_most_four_times_per_step(launch, tmp_path, name):
    out = tmp_path / "res"
    cluster, mode, extra, transport = CASES[name]
    workers = sum(m.get("gpus", 1) for m in cluster["machines"] if m["role"] == "worker")
    rc, log, _ = launch("engine_entries.py", str(out), cluster=cluster, mode=mode, timeout=30, extra=extra)
    assert rc == 0, log
    for r in range(workers):
        counts = json.loads((out / f"rank{r}.json").read_text())
        weights = torch.load(out / f"rank{r}.pt", weights_only=True)
        if r < 2:
            assert counts["overlap=True/few"]["transport"] == transport, (name, r, counts["overlap=True/few"])
        for overlap in (True, False):
            few, many = counts[f"overlap={overlap}/few"], counts[f"overlap={overlap}/many"]
            what = f"{name} overlap={overlap} rank {r}"
            assert few["parts"] == many["parts"] > (1 if mode == "allreduce" else 0), (what, few, many)
            assert many["grads"] - few["grads"] == 32, what
            per_gradient = (many["calls"] - few["calls"]) / (many["grads"] - few["grads"]) / many["steps"]
            print(f"{what}: {per_gradient:.2f} calls per gradient per step; per step {few['calls'] / few['steps']:.0f} "
                  f"({few['grads']} gradients), {many['calls'] / many['steps']:.0f} ({many['grads']})")
            assert 0 < per_gradient <= MAX_PER_GRADIENT, (
                f"{what}: {per_gradient:.2f} calls per gradient per step; the many-tensor model's calls: "
                f"{many['by_function']}; the few-tensor model's: {few['by_function']}")
            for size in ("few", "many"):
                want = case.train({"few": 2, "many": 18}[size], overlap, wrap=False)[0].state_dict()
                got = weights[f"overlap={overlap}/{size}"]
                for k, w in want.items():
                    torch.testing.assert_close(got[k], w, rtol=1e-4, atol=1e-6, msg=f"{what} {size} {k}")
