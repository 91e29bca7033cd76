"""Workers that train on no sample leave the gradient exchange (hetrain.api.members): the
others exchange among themselves, a worker that rejoins is re-synchronised first, and the
result is one process's on the same samples, with summation servers or without."""
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import SCRIPTS, small_cluster

sys.path.insert(0, str(SCRIPTS))
from reference import GLOBAL_BATCH, single_process  # noqa: E402

HERE = Path(__file__).parent / "scripts"
sys.path.insert(0, str(HERE))
from leave_exchange import SETS  # noqa: E402


def _check(out: Path, workers: int = 3) -> None:
    ref = single_process([torch.arange(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH) for s in range(len(SETS))])
    for r in range(workers):
        got = torch.load(out / f"rank{r}.pt")
        # every worker ends with one process's parameters (those that sat out: brought up to date at the end)
        for name, want in ref.items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
        steps_in = sum(r in s for s in SETS)
        assert got["exchanges"] == steps_in and got["sat_out"] == len(SETS) - steps_in, got
        # a worker out of a step's set put nothing on the wire in it, nor one alone in its set
        assert got["moved"] == [r in s and len(s) > 1 for s in SETS], got["moved"]
        # rejoins at step 4 (worker 2) and 6 (workers 0 and 2), and at the end (worker 1)
        assert got["resyncs"] == 3, got


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allreduce", "byteps"])
def test_left_workers_take_no_part_and_rejoin_resynchronised(launch, tmp_path, mode):
    """A fixed schedule of exchange sets (all, two, all, one, two) over 8 steps: the
    result equals one process on every step's 24 samples; with summation servers (byteps)
    the steps without every worker do not wait for the servers, nor the servers hang."""
    out = tmp_path / "params"
    rc, log, _ = launch(str(HERE / "leave_exchange.py"), str(out), cluster=small_cluster(3, 1 if mode != "allreduce"
                                                                                          else 0), mode=mode,
                        timeout=30, limit=300)
    assert rc == 0, log
    _check(out)
