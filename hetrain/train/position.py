"""Where a balanced job is in its data: the epoch and the step of it, committed by an
elastic job and restored into a run whose workers may differ (mixed into
`balanced_sampler.BalancedBatchSampler`, whose `sampler` is the global-batch sampler
that holds the position and whose `len()` is the steps of an epoch)."""
from __future__ import annotations


class DataPosition:
    """The position in the data (epoch, step) and what fixes the order."""

    @property
    def epoch(self) -> int:
        """The epoch the position is in."""
        return self.sampler.epoch

    @property
    def step(self) -> int:
        """Steps of `epoch` done: their updates applied (the wrapped optimizer's step
        returned) or the next step asked for. `len(self)`: the epoch is over."""
        return self.sampler.step

    def state_dict(self) -> dict:
        """The position (epoch, step) and what fixes the data order (seed, sizes). Shares
        are not kept: a restored job measures its own workers afresh."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position `state_dict` gave: the next iteration yields the
        remaining steps of its epoch, cut by the shares of this run's workers (the
        global batches depend on (seed, epoch, step) only, so every remaining sample of
        the epoch is still seen exactly once, whatever the number of workers)."""
        self.sampler.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        """The next iteration runs this epoch from its start (default: the epoch after
        the last, or the rest of a restored one; setting the restored epoch keeps its
        position)."""
        pos = self.sampler
        if int(epoch) != pos.epoch or pos.step >= len(self):
            pos.epoch, pos.step = int(epoch), 0

    def epochs(self, num_epochs: int):
        """Epoch numbers from the position on, below `num_epochs`:
        `for epoch in loader.epochs(N): for x, y in loader: ...` runs the epochs left
        (after a restore, the rest of the committed one first)."""
        pos = self.sampler
        while True:
            if pos.step >= len(self):
                pos.epoch, pos.step = pos.epoch + 1, 0
            if pos.epoch >= num_epochs:
                return
            epoch = pos.epoch
            yield epoch
            if pos.epoch == epoch and pos.step < len(self):  # the loop left the epoch early: on to the next
                pos.epoch, pos.step = epoch + 1, 0
