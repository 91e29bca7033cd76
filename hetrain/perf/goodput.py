"""Goodput: a job's useful progress per second, throughput x statistical efficiency.

The model of Pollux (OSDI'21) that Sia (SOSP'23) schedules with, in numpy only:

- **Gradient noise scale** phi = tr(Sigma) / |G|^2 (McCandlish et al., 2018): how
  noisy one sample's gradient is against the true gradient. The workers measure it
  from what they already compute: each worker's local gradient (batch b) and the
  summed global one (batch B = W b). Since E|g_b|^2 = |G|^2 + tr(Sigma)/b, the two
  norms give unbiased estimates of both moments:
      |G|^2    ~ (B |g_B|^2 - b |g_b|^2) / (B - b)
      tr(Sig)  ~ (|g_b|^2 - |g_B|^2) / (1/b - 1/B)
  Single estimates are very noisy (and |G|^2 can come out negative), so the noise
  scale is the ratio of the *averaged* moments (`fit_noise_scale`), or of their
  exponential moving averages online (`NoiseScaleTracker`), as AdaptDL does.
- **Statistical efficiency** of a global batch M against the job's base batch M0:
      E(M) = (phi + M0) / (phi + M)
  one sample at batch M makes E(M) of the progress one sample makes at M0.
- **Throughput at batch M**: a job's base scaling curve gives its step time at M0 on
  g GPUs of a type; a larger batch adds its extra per-GPU compute,
      step(T, g, M) = step(T, g, M0) + c_T (M - M0) / g
  where c_T (seconds per sample on one GPU of type T) comes from a one-GPU profile
  at two or more batch sizes (`fit_one_gpu`), refined online from measured steps.
- **Goodput** in base steps per second (one base step = M0 samples at efficiency 1,
  the unit a job's remaining work is counted in):
      goodput(T, g, M) = (M / M0) E(M) / step(T, g, M)
  and a job's speed on (T, g) is its goodput at the best batch in [M0, max_batch]
  whose per-GPU share fits the type's memory (`BatchModel.goodput_table`). At M = M0
  it is the base rate, so adapting the batch never makes a configuration slower.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import numpy as np

from ..errors import UserError  # dependency-free: perf stays numpy-only


@dataclass(frozen=True)
class NoiseSample:
    """One step's gradient norms: `local_sqr` is the mean over workers of |g_b|^2 (each
    worker's mean gradient over its `local_batch` samples), `global_sqr` is |g_B|^2 of
    the mean gradient over the `global_batch` samples of all workers."""

    local_sqr: float
    global_sqr: float
    local_batch: float
    global_batch: float


def gradient_moments(samples: Sequence[NoiseSample]) -> tuple[np.ndarray, np.ndarray]:
    """Per-step unbiased estimates of (|G|^2, tr Sigma); steps with b == B carry none."""
    b = np.array([s.local_batch for s in samples], dtype=float)
    B = np.array([s.global_batch for s in samples], dtype=float)
    gb = np.array([s.local_sqr for s in samples], dtype=float)
    gB = np.array([s.global_sqr for s in samples], dtype=float)
    ok = B > b
    b, B, gb, gB = b[ok], B[ok], gb[ok], gB[ok]
    sqr = (B * gB - b * gb) / (B - b)
    var = (gb - gB) / (1.0 / b - 1.0 / B)
    return sqr, var


def fit_noise_scale(samples: Sequence[NoiseSample]) -> float:
    """phi = mean tr(Sigma) / mean |G|^2 over the steps (the ratio of means: a mean of
    per-step ratios is biased by the noisy denominators)."""
    sqr, var = gradient_moments(samples)
    if len(sqr) == 0:
        raise UserError("the gradient noise scale needs steps on 2 or more workers (local batch < global batch)")
    g, v = float(sqr.mean()), float(var.mean())
    if g <= 0:
        return float("inf")  # gradient signal not yet resolved from noise: any batch is efficient
    return max(0.0, v / g)


class NoiseScaleTracker:
    """Online noise scale: exponential moving averages of both moments (AdaptDL's
    estimator), refined at every measured step."""

    def __init__(self, smoothing: float = 0.9, prior: float | None = None):
        if not 0 <= smoothing < 1:
            raise UserError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.prior = prior
        self._sqr = self._var = 0.0
        self._weight = 0.0  # bias correction of the moving averages (as in Adam)

    def update(self, sample: NoiseSample) -> None:
        sqr, var = gradient_moments([sample])
        if len(sqr) == 0:
            return
        a = self.smoothing
        self._sqr = a * self._sqr + (1 - a) * float(sqr[0])
        self._var = a * self._var + (1 - a) * float(var[0])
        self._weight = a * self._weight + (1 - a)

    @property
    def noise_scale(self) -> float | None:
        if self._weight == 0:
            return self.prior
        if self._sqr <= 0:
            return float("inf")
        return max(0.0, self._var / self._sqr)


def efficiency(batch, base_batch: float, noise_scale: float):
    """Statistical efficiency E(M) = (phi + M0) / (phi + M) (1 at M0; inf noise: 1)."""
    m = np.asarray(batch, dtype=float)
    if not np.isfinite(noise_scale):
        return np.ones_like(m) if m.ndim else 1.0
    return (noise_scale + base_batch) / (noise_scale + m)


def fit_one_gpu(batches: Sequence[float], step_s: Sequence[float]) -> tuple[float, float]:
    """(fixed seconds, seconds per sample) of one GPU's step time t(b) = a + c b, by
    non-negative least squares over a one-GPU profile at two or more batch sizes."""
    b = np.asarray(batches, dtype=float)
    t = np.asarray(step_s, dtype=float)
    if len(b) < 2 or len(set(b.tolist())) < 2:
        raise UserError("a one-GPU profile needs step times at 2 or more batch sizes")
    sol, *_ = np.linalg.lstsq(np.stack([np.ones_like(b), b], axis=1), t, rcond=None)
    a, c = float(sol[0]), float(sol[1])
    if c < 0:  # step time not growing with the batch: all fixed cost
        return float(t.mean()), 0.0
    if a < 0:  # all per-sample: through the origin
        return 0.0, float((b @ t) / (b @ b))
    return a, c


@dataclass(frozen=True)
class BatchModel:
    """What a job's batch size may be and what it costs, per GPU type.

    base_batch M0: the global batch the job's work and base scaling curve are counted
    at; max_batch: the largest global batch the job accepts; per_sample_s[T]: extra
    compute seconds per sample on one GPU of type T; max_local[T]: the largest per-GPU
    batch that fits T's memory (types absent: no limit); noise_scale phi in samples.
    """

    base_batch: int
    max_batch: int
    noise_scale: float
    per_sample_s: Mapping[str, float]
    max_local: Mapping[str, int]

    def __post_init__(self) -> None:
        if self.base_batch < 1 or self.max_batch < self.base_batch:
            raise UserError(f"batch range must satisfy 1 <= base_batch <= max_batch, got "
                            f"[{self.base_batch}, {self.max_batch}]")
        if not self.noise_scale >= 0:
            raise UserError(f"noise_scale must be >= 0 samples, got {self.noise_scale}")
        if any(c < 0 for c in self.per_sample_s.values()):
            raise UserError("per_sample_s must be >= 0 seconds for every GPU type")

    def with_noise_scale(self, noise_scale: float) -> "BatchModel":
        return BatchModel(self.base_batch, self.max_batch, noise_scale, self.per_sample_s, self.max_local)

    def grid(self) -> np.ndarray:
        """Candidate global batches: M0 doubled up to max_batch, and max_batch."""
        out, m = [], self.base_batch
        while m < self.max_batch:
            out.append(m)
            m *= 2
        out.append(self.max_batch)
        return np.array(out, dtype=float)

    def goodput_table(self, base_rates: np.ndarray, gpu_types: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(goodput[t, g], best batch[t, g]) from the base rates[t, g] (base steps/s at M0,
        column 0 zero): the best batch of the grid per configuration; 0 where it cannot run."""
        rates = np.asarray(base_rates, dtype=float)
        m = self.grid()                                        # (k,)
        g = np.arange(rates.shape[1], dtype=float)             # (G,)
        with np.errstate(divide="ignore"):
            step0 = np.where(rates > 0, 1.0 / np.where(rates > 0, rates, 1.0), np.inf)  # (T, G)
        c = np.array([self.per_sample_s.get(t, 0.0) for t in gpu_types])             # (T,)
        cap = np.array([self.max_local.get(t, np.inf) for t in gpu_types], dtype=float)
        gg = np.maximum(g, 1.0)
        step = step0[:, :, None] + c[:, None, None] * (m[None, None, :] - self.base_batch) / gg[None, :, None]
        eff = efficiency(m, self.base_batch, self.noise_scale)
        good = (m / self.base_batch * eff)[None, None, :] / step
        local = np.ceil(m[None, :] / gg[:, None])               # (G, k)
        fits = local[None, :, :] <= cap[:, None, None]
        fits[:, :, 0] = True                                    # M0 runs wherever the base curve says so
        good = np.where(fits & np.isfinite(step), good, 0.0)
        best = np.argmax(good, axis=2)
        table = np.take_along_axis(good, best[:, :, None], axis=2)[:, :, 0]
        table[:, 0] = 0.0
        table[rates <= 0] = 0.0
        batch = np.where(table > 0, m[best], 0).astype(np.int64)
        return table, batch


LrRule = Literal["sqrt", "linear"]


def scale_lr(lr: float, old_batch: int, new_batch: int, rule: LrRule = "sqrt") -> float:
    """The learning rate for a new global batch: square-root scaling (the default;
    lr x sqrt(new/old), safe for adaptive optimizers and SGD alike) or linear
    (Goyal et al., for SGD with warm-up). AdaScale's gain is left to the trainer."""
    if old_batch < 1 or new_batch < 1:
        raise UserError(f"batch sizes must be >= 1, got {old_batch} -> {new_batch}")
    ratio = new_batch / old_batch
    if rule == "sqrt":
        return lr * ratio ** 0.5
    if rule == "linear":
        return lr * ratio
    raise UserError(f"unknown learning-rate rule {rule!r}; use 'sqrt' or 'linear'")
