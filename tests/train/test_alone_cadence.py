"""While one worker trains alone by speed, the balancer's exchanges come at a cadence
set in time, not steps (hetrain.train.balance_exchange `_alone_cadence`): short steps
exchange every few windows, long ones every window. Pure, in one process."""
import numpy as np
import pytest

from hetrain.train.balance import BalanceConfig, Balancer
from hetrain.train.balance_exchange import ALONE_EXCHANGE_S, SOLO_EVERY
from hetrain.train.exchange import InProcessExchange

from .lockstep import drive


def _exchange_steps(per_sample: float, window: int,
                    steps: int = 400) -> tuple[list[list[int]], list[list[int]], Balancer]:
    """Two workers, the second 20x slower a sample with a fixed part of its own, so the
    first trains alone (no probes, no trials). Returns the shares per step, each worker's
    steps at which it started an exchange, and the first worker's balancer."""
    ex = InProcessExchange(2)
    posted: list[list[int]] = [[], []]
    bal: list[Balancer] = []

    def counting(r: int):
        gather = ex.gather_for(r)

        def g(row):
            posted[r].append(bal[r].step if len(bal) > r else 0)
            return gather(row)
        return g
    for r in range(2):
        bal.append(Balancer(None, 100, BalanceConfig(window=window, probe_every=0), gather=counting(r), num_workers=2))
    fixed, per = np.array([0.0, 5e-3]), np.array([per_sample, 20 * per_sample])
    shares = drive(bal, steps, lambda step, sizes: fixed + per * sizes, leave=True)
    return shares, posted, bal[0]


@pytest.mark.parametrize("per_sample, window, gap", [(1e-5, 16, SOLO_EVERY), (2e-4, 16, 16), (1e-5, 10, SOLO_EVERY),
                                                     (2e-4, 10, 10), (6e-5, 10, 20)])
def test_a_lone_worker_exchanges_once_per_a_tenth_of_a_second_of_its_steps(per_sample, window, gap):
    """Doubled from the window while under a tenth of a second of its predicted steps, up
    to `SOLO_EVERY` (a window of 10 stops there, not at 80)."""
    shares, posted, first = _exchange_steps(per_sample, window)
    alone = [k for k, s in enumerate(shares) if s == [100, 0]]
    assert len(alone) > 0.8 * len(shares), shares[:40]
    assert posted[0] == posted[1]  # every worker exchanges at the same steps
    start = alone[0] + 2 * SOLO_EVERY  # past the exchange that set the cadence
    gaps = set(np.diff([s for s in posted[0] if s >= start]).tolist())
    assert gaps == {gap}, posted[0]
    step_s = first.plan.predicted  # the lone worker's predicted step
    assert gap * step_s >= ALONE_EXCHANGE_S or gap == SOLO_EVERY
    assert gap == window or (gap // 2) * step_s < ALONE_EXCHANGE_S
