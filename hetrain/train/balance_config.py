"""How a balanced job's shares follow measured step times: `BalanceConfig`, validated so
a bad value fails before training starts (the balancer itself: hetrain.train.balance)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import UserError
from ..perf.steptime import SMALL_SHARE


@dataclass(frozen=True)
class BalanceConfig:
    """How shares follow measured step times. Validated so a bad value fails before training starts."""

    policy: Literal["measured", "equal"] = "measured"  # equal: fixed equal shares (capped by memory), still measured
    window: int = 16  # steps the fixed part is fitted on (robust regression over the window)
    recent: int = 5  # the level follows the median over the last `recent` steps (two outliers do not move shares)
    # exchange fits and re-balance every `every` steps (equal shares: every `window` steps,
    # for the metrics only). Each exchange is a collective, which on a loaded or 1-core
    # worker costs a thread hand-off per step; 2 halves that, shares follow a step later
    every: int = 2
    overlap_exchange: bool = True  # a step's exchange completes during the next step (shares one step older)
    memory_per_sample: float = 0.0  # device bytes one sample needs (activations + their grads); 0: no cap
    reserved_bytes: float = 0.0  # device bytes taken before any sample (parameters, grads, optimizer state)
    min_samples: int = 1  # a worker that takes part gets at least this many samples (its speed stays measurable)
    # a worker whose best share is under this fraction of an equal share sits out: it would
    # shorten the compute by a few percent at most, and its part in the exchange costs more
    # (0: only workers too slow to help at all sit out)
    small_share: float = SMALL_SHARE
    # a worker sitting out rejoins once its best share reaches `rejoin` x small_share (1: at
    # small_share): the fits of the workers that stay move with step noise, and one on the
    # edge would otherwise join and leave on alternate re-balances, paying its exchange in
    # every step it is in for a sliver of samples
    rejoin: float = 2.0
    # a worker sitting out trains again for ceil(recent/2) steps after this many, to be
    # measured (its fit stands still while it is out), the wait doubling each time it
    # stays out (train/probe.py; 0: never)
    probe_every: int = 64
    # a new split replaces the current one only where it is predicted faster by more than
    # this fraction of the step: each new local batch size is a new input shape, which
    # kernels built per shape pay for again on first sight (oneDNN convolutions on a CPU,
    # cuDNN autotuning, torch.compile), and shares re-solved on step noise wander by a few
    # samples; a real change of speed (interference, a straggler) is far above it
    hold: float = 0.01
    # ... and by this many standard errors of the fits' level where that is more (the
    # step-to-step noise of a shared host: a CNN's shares re-solved on it wandered by 5%)
    hold_noise: float = 2.0
    # unequal: one local batch per worker, sizes by speed, batch-weighted average (H-PS);
    # accumulate: equal micro-batches, a count per worker (gradient accumulation, IIDP);
    # auto: the one the step-time model predicts faster for the measured workers
    strategy: Literal["auto", "unequal", "accumulate"] = "auto"
    micro_batch: int = 0  # accumulate's micro-batch (0: global batch / (2 x workers), at least 1)
    # a fraction of every step's samples handed out while the step runs, a chunk at a time,
    # to whichever worker asks first (hetrain.train.tail): absorbs step-to-step speed noise
    tail: float = 0.0
    tail_chunks: int = 3  # tail chunks each worker expects per step (each is a pass: it pays the fixed part)
    # a worker with no samples in a step leaves that step's gradient exchange (the others
    # exchange among themselves, hetrain.api.members), and the exchange is priced when the
    # workers of a step are chosen (hetrain.perf.exchangeset): a set of devices joins only
    # where the predicted step with its exchange beats the best subset without it.
    # Needs the job's own workers and the optimizer (BalancedLoader(optimizer=...)); off
    # with tail > 0 (a worker with no share may claim tail samples). False: every worker
    # takes part in every exchange, a worker at share 0 with weight 0
    leave: bool = True

    def __post_init__(self) -> None:
        if self.policy not in ("measured", "equal"):
            raise UserError(f"balance policy must be 'measured' or 'equal', got {self.policy!r}")
        if self.window < 2:
            raise UserError(f"balance window must be >= 2 steps, got {self.window}")
        if not 1 <= self.recent <= self.window:
            raise UserError(f"balance recent must be between 1 and window={self.window} steps, got {self.recent}")
        if self.every < 1:
            raise UserError(f"balance every must be >= 1 step, got {self.every}")
        if self.memory_per_sample < 0 or self.reserved_bytes < 0:
            raise UserError("memory_per_sample and reserved_bytes must be >= 0 bytes")
        if self.min_samples < 0:
            raise UserError("min_samples must be >= 0")
        if not 0.0 <= self.small_share < 1.0:
            raise UserError("small_share must be a fraction of an equal share in [0, 1) (0: off), "
                            f"got {self.small_share}")
        if self.probe_every < 0:
            raise UserError(f"probe_every must be >= 0 steps (0: never), got {self.probe_every}")
        if not self.rejoin >= 1.0:
            raise UserError(f"rejoin must be >= 1 (a multiple of small_share), got {self.rejoin}")
        if not 0.0 <= self.hold < 1.0:
            raise UserError(f"hold must be a fraction of the step in [0, 1) (0: always re-split), got {self.hold}")
        if not self.hold_noise >= 0.0:
            raise UserError(f"hold_noise must be >= 0 standard errors (0: hold alone), got {self.hold_noise}")
        if self.strategy not in ("auto", "unequal", "accumulate"):
            raise UserError(f"balance strategy must be 'auto', 'unequal' or 'accumulate', got {self.strategy!r}")
        if not 0.0 <= self.tail < 1.0:
            raise UserError(f"tail must be a fraction of the batch in [0, 1) (0: off), got {self.tail}")
        if self.tail_chunks < 1:
            raise UserError(f"tail_chunks must be >= 1 chunk per worker, got {self.tail_chunks}")
        if self.micro_batch < 0:
            raise UserError(f"micro_batch must be >= 0 samples (0: a default), got {self.micro_batch}")
