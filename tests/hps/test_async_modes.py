"""Asynchronous and bounded-staleness training never exceed their bound (real processes)."""
import json
from pathlib import Path

import pytest

HPS = Path(__file__).parent / "scripts"
FAST_SLOW = {"name": "t", "machines": [
    {"name": "w0", "role": "worker", "device": {"speed": 1.0}},
    {"name": "w1", "role": "worker", "device": {"speed": 0.2}},
    {"name": "c0", "role": "cpu"}]}
STEPS = 12


def _run(launch, tmp_path, sync, bound):
    out = tmp_path / sync
    rc, log, run_dir = launch(str(HPS / "async_train.py"), str(out), str(STEPS), cluster=FAST_SLOW, mode="ps",
                              extra=("--sync", sync, "--staleness", str(bound)))
    assert rc == 0, log
    workers = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    server = json.loads((run_dir / "ps-server0.json").read_text())
    assert server["pushes"] == 2 * STEPS and all(w["clock"] == STEPS for w in workers)
    for w in workers:  # the servers' SGD trained the model both workers pulled
        assert w["final_full_loss"] < w["start_full_loss"]
    return workers, server


@pytest.mark.slow
def test_bounded_staleness_never_exceeds_bound(launch, tmp_path):
    workers, server = _run(launch, tmp_path, "stale", 2)
    assert server["bound"] == 2
    assert server["max_gap"] <= 2 and all(w["max_gap"] <= 2 for w in workers)
    assert max(w["max_gap"] for w in workers) == 2  # the fast worker did run ahead, up to the bound


@pytest.mark.slow
def test_async_lets_the_fast_worker_run_ahead(launch, tmp_path):
    workers, server = _run(launch, tmp_path, "async", 0)
    assert server["bound"] is None
    # the fast worker (5x faster) is never held back: it runs well past any small bound
    assert workers[0]["max_gap"] > 2 and server["max_gap"] >= workers[0]["max_gap"], (workers, server)


@pytest.mark.slow
def test_staleness_zero_is_synchronous_sgd_on_the_global_batch(launch, tmp_path):
    """Bound 0 with plain SGD: every push is weighted by its worker's share of the global
    batch (unequal batches 4, 8, 12, known from the first round on), so the parameter
    servers make exactly the single-process update."""
    import sys

    import torch

    from tests.helpers import SCRIPTS, small_cluster

    sys.path.insert(0, str(SCRIPTS))
    from reference import single_process

    out = tmp_path / "params"
    rc, log, _ = launch("equiv_train.py", str(out), "--sgd", cluster=small_cluster(workers=3, cpus=1), mode="ps",
                        extra=("--sync", "stale", "--staleness", "0"))
    assert rc == 0, log
    ref = single_process(momentum=0.0)
    for r in range(3):
        got = torch.load(out / f"rank{r}.pt")
        for name, want in ref.items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
