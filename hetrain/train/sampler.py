"""Global-batch sampling with uneven per-worker shares.

Every epoch is one seeded permutation cut into global batches; each global batch is
cut into per-worker slices by the current shares (largest remainder, so slices add
up exactly). Hence every sample is seen exactly once per epoch whatever the shares,
every worker runs the same number of steps, and shares may change between steps.

The sampler also keeps the job's position in the data (epoch, step within it), which
an elastic job commits (`hetrain.train.elastic.State(sampler=...)`). Global batch `s`
of epoch `e` depends on (seed, e, s) only, never on the number of workers, so a job
restored mid-epoch on more or fewer workers sees every remaining sample of the epoch
exactly once: the restored position, re-split by the new shares. A run may also resume
with another global batch (a scheduler that adapts the batch hands it a new one on a
restart): the position is then the samples of the epoch already seen, and the rest of
that epoch is cut into the new global batches from there (`head`).
"""
from __future__ import annotations

import numpy as np

from ..comm.partition import largest_remainder


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch: int, num_workers: int, seed: int = 0):
        if global_batch < num_workers:
            raise ValueError(f"global batch {global_batch} is smaller than the {num_workers} workers; raise it")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.num_workers = num_workers
        self.seed = seed
        self.epoch = 0  # position: the next step to run is `step` of `epoch`
        self.step = 0
        # (epoch, samples of it seen before its step 0): set where a run resumed mid-epoch
        # with another global batch; that epoch's steps start after those samples
        self.head = (0, 0)

    # ---- the position (committed by an elastic job) -------------------------------------
    def epochs(self, num_epochs: int):
        """Epochs from the current position on. The position moves to the next epoch
        when the loop comes back for it (after the epoch's own end-of-epoch work)."""
        while self.epoch < num_epochs:
            yield self.epoch
            self.epoch += 1
            self.step = 0

    def steps(self):
        """Steps of the current epoch from the current position on. The position moves
        past a step when the loop comes back for the next one, so commit at the top of
        a step: the committed position is the step not run yet."""
        while self.step < self.steps_per_epoch():
            yield self.step
            self.step += 1

    @property
    def global_step(self) -> int:
        return self.epoch * self.steps_per_epoch() + self.step

    def state_dict(self) -> dict:
        return {"seed": self.seed, "num_samples": self.num_samples, "global_batch": self.global_batch,
                "epoch": self.epoch, "step": self.step, "head": list(self.head)}

    def load_state_dict(self, state: dict) -> None:
        from ..errors import UserError

        for k in ("seed", "num_samples"):
            if int(state[k]) != getattr(self, k):
                raise UserError(f"the committed data position was taken with {k}={state[k]}, this run has "
                                f"{k}={getattr(self, k)}: the data order would differ; resume with the same {k} or "
                                "start in a fresh run directory")
        epoch, step = int(state["epoch"]), int(state["step"])
        head = tuple(int(v) for v in state.get("head", (0, 0)))
        if int(state["global_batch"]) == self.global_batch:
            self.head, self.epoch, self.step = head, epoch, step
            return
        # another global batch: continue after the samples of the epoch already seen
        seen = (head[1] if head[0] == epoch else 0) + step * int(state["global_batch"])
        if seen >= self.num_samples:
            epoch, seen = epoch + 1, 0
        self.head, self.epoch, self.step = (epoch, seen), epoch, 0

    def offset(self, epoch: int) -> int:
        """Samples of `epoch` seen before its step 0 (0 but where a run changed batch)."""
        return self.head[1] if epoch == self.head[0] else 0

    def steps_per_epoch(self, epoch: int | None = None) -> int:
        e = self.epoch if epoch is None else epoch
        return -(-(self.num_samples - self.offset(e)) // self.global_batch)

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)

    def global_batch_at(self, epoch: int, step: int) -> np.ndarray:
        perm = self.order(epoch)
        start = self.offset(epoch) + step * self.global_batch
        return perm[start: start + self.global_batch]

    def split(self, batch: np.ndarray, shares) -> list[np.ndarray]:
        sizes = largest_remainder(len(batch), np.asarray(shares, dtype=float))
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        return [batch[bounds[i]: bounds[i + 1]] for i in range(len(sizes))]

    def indices(self, epoch: int, step: int, worker: int, shares=None) -> np.ndarray:
        shares = np.ones(self.num_workers) if shares is None else shares
        return self.split(self.global_batch_at(epoch, step), shares)[worker]
