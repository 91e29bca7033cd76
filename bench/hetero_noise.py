"""How much of a real case's gap to its ideal is the host's step-to-step noise, which no
fixed split of the batch removes (bench/hetero_cases.py reports it beside the ideal).

The ideal finishes every worker together by their fitted speeds, as if each step took
exactly what the fits say. On a shared host a worker's forward+backward varies from step
to step (another process on its core, cache and memory-bandwidth contention, the
hypervisor), and a synchronous step ends when its later worker does: shares fixed before a
step pay the expected maximum of the workers' noise, where the ideal pays their fits.
`noise_penalty` replays a run's own steps: each worker's measured compute over what its
fit predicts for the samples it had (its noise, scaled to mean 1 so the fits keep their
level) applied to every fixed split of each global batch; the best split's mean step
minus the best split's mean step without the noise is what the noise costs any fixed
split, an oracle's included. Two workers (a split is one fraction, searched on a grid).
"""
from __future__ import annotations

import numpy as np

GRID = 512  # fractions of each batch tried for worker 0


def _best_split_step(fixed: np.ndarray, slope: np.ndarray, batch: np.ndarray, noise: np.ndarray) -> float:
    """The least mean over steps of the later worker's compute, over fixed fractions of
    each step's batch given to worker 0 (a worker given no sample takes no time)."""
    frac = np.arange(1, GRID)[:, None] / GRID  # fractions x 1
    n0 = np.round(frac * batch[None, :])
    n1 = batch[None, :] - n0
    t0 = np.where(n0 > 0, (fixed[0] + slope[0] * n0) * noise[0], 0.0)
    t1 = np.where(n1 > 0, (fixed[1] + slope[1] * n1) * noise[1], 0.0)
    return float(np.min(np.maximum(t0, t1).mean(axis=1)))


def noise_penalty(phases: np.ndarray, fixed, slope) -> float | None:
    """Seconds per step that step-to-step noise costs the best fixed split, replayed on a
    run's measured steps (`phases`: ranks x steps x fields, bench/real_worker.py: forward
    and backward seconds at 1 and 2, samples at 5) for workers whose forward+backward
    takes fixed + slope x samples. None unless two workers that each trained every step."""
    fixed, slope = np.asarray(fixed, dtype=float), np.asarray(slope, dtype=float)
    n = phases[:, :, 5]
    if n.shape[0] != 2 or n.shape[1] == 0 or (n <= 0).any():
        return None
    fb = phases[:, :, 1] + phases[:, :, 2]
    noise = fb / (fixed[:, None] + slope[:, None] * n)
    noise = noise / noise.mean(axis=1, keepdims=True)  # noise only: the fits keep each worker's level
    batch = n.sum(axis=0)
    return _best_split_step(fixed, slope, batch, noise) - _best_split_step(fixed, slope, batch, np.ones_like(noise))


def step_noise(phases: np.ndarray) -> float:
    """The step-to-step noise of a run's compute: per worker, forward+backward over its
    median at the same batch size (an epoch's last batch is smaller), as a robust
    relative standard deviation (1.4826 x the median absolute deviation); the largest
    over the workers. `phases` as for `noise_penalty`."""
    n, fb = phases[:, :, 5], phases[:, :, 1] + phases[:, :, 2]
    out = []
    for w in range(n.shape[0]):
        keep = n[w] > 0
        if keep.sum() < 3:
            continue
        r = fb[w][keep] / np.array([np.median(fb[w][keep][n[w][keep] == v]) for v in n[w][keep]])
        out.append(1.4826 * float(np.median(np.abs(r - np.median(r)))))
    return max(out, default=float("nan"))
