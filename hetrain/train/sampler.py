"""Global-batch sampling with uneven per-worker shares.

Every epoch is one seeded permutation cut into global batches; each global batch is
cut into per-worker slices by the current shares (largest remainder, so slices add
up exactly). Hence every sample is seen exactly once per epoch whatever the shares,
every worker runs the same number of steps, and shares may change between steps.
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

    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch)

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)

    def global_batch_at(self, epoch: int, step: int) -> np.ndarray:
        perm = self.order(epoch)
        return perm[step * self.global_batch: (step + 1) * self.global_batch]

    def split(self, batch: np.ndarray, shares) -> list[np.ndarray]:
        sizes = largest_remainder(len(batch), np.asarray(shares, dtype=float))
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        return [batch[bounds[i]: bounds[i + 1]] for i in range(len(sizes))]

    def indices(self, epoch: int, step: int, worker: int, shares=None) -> np.ndarray:
        shares = np.ones(self.num_workers) if shares is None else shares
        return self.split(self.global_batch_at(epoch, step), shares)[worker]
