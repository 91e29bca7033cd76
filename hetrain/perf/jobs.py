"""Job scaling model: how fast a data-parallel job progresses on g GPUs of one type.

This is the one cost model shared by the scheduling policies, the simulator and the
real executor (numpy only). Two curves, both answering `rate(gpu_type, g)` in *work
units per second* (a work unit is whatever the job's remaining work is counted in:
global steps, or per-GPU minibatches as in Gavel's measurements):

- `RingCurve`: ring maths, T(g) = overhead + T_compute(batch/g) + 2(g-1)/g·M/B + 2(g-1)·lat,
  built on `hetrain.perf.comm.ring_allreduce_time`. Fixed global batch (strong scaling,
  one unit = one global step) or fixed per-GPU batch (weak scaling, one step = g units).
- `TableCurve`: measured rates per GPU type and count (Gavel's
  `simulation_throughputs.json`), linearly interpolated between measured counts.

`fit_ring` fits the ring form to measured step times (least squares, non-negative
coefficients), which is how the executor turns a few timed steps into a curve.
`rate_table` turns any curve into a dense (types × counts) array so policies and the
simulator look rates up in O(1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import numpy as np

from ..errors import UserError  # dependency-free: perf stays numpy-only
from .comm import ring_allreduce_time


class ScalingCurve(Protocol):
    def rate(self, gpu_type: str, g: int) -> float:
        """Work units per second on g GPUs of gpu_type; 0 means the job cannot run so."""

    def max_gpus(self, gpu_type: str) -> int:
        """Largest GPU count of this type the curve knows (0: the type is unusable)."""


@dataclass(frozen=True)
class RingCurve:
    """Ring all-reduce step-time model.

    compute_s[type]: seconds of forward+backward for one step's batch on ONE GPU of that
    type (strong scaling: the batch is split, so compute is compute_s/g; weak scaling:
    every GPU does compute_s). model_bytes / bandwidth / latency feed the ring formula.
    """

    compute_s: Mapping[str, float]
    model_bytes: float = 0.0
    bandwidth: float = 1.25e9
    latency: float = 0.0
    overhead_s: float = 0.0
    weak: bool = False
    max_g: int = 64

    def __post_init__(self) -> None:
        if not self.compute_s:
            raise UserError("RingCurve needs compute_s for at least one GPU type, e.g. {'v100': 0.1}")
        for t, c in self.compute_s.items():
            if not c > 0:
                raise UserError(f"compute_s[{t!r}] must be > 0 seconds, got {c}")
        if self.bandwidth <= 0:
            raise UserError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.model_bytes < 0 or self.latency < 0 or self.overhead_s < 0:
            raise UserError("model_bytes, latency and overhead_s must be >= 0")
        if self.max_g < 1:
            raise UserError(f"max_g must be >= 1, got {self.max_g}")

    def step_time(self, gpu_type: str, g: int) -> float:
        c = self.compute_s[gpu_type]
        compute = c if self.weak else c / g
        return self.overhead_s + compute + ring_allreduce_time(self.model_bytes, g, self.bandwidth, self.latency)

    def rate(self, gpu_type: str, g: int) -> float:
        if g < 1 or g > self.max_g or gpu_type not in self.compute_s:
            return 0.0
        units = g if self.weak else 1
        return units / self.step_time(gpu_type, g)

    def max_gpus(self, gpu_type: str) -> int:
        return self.max_g if gpu_type in self.compute_s else 0


@dataclass(frozen=True)
class TableCurve:
    """Measured rates: rates[type][g] in work units/s. Counts between two measured
    counts are interpolated linearly; counts above the largest measured one (or with a
    zero measurement, e.g. out of memory) are not allowed."""

    rates: Mapping[str, Mapping[int, float]]
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def _points(self, gpu_type: str) -> tuple[np.ndarray, np.ndarray]:
        if gpu_type not in self._cache:
            pts = []
            # keep only the prefix of counts that run (a zero at g=2 makes g>=2 unusable)
            for g, r in sorted((int(g), float(r)) for g, r in self.rates.get(gpu_type, {}).items()):
                if not r > 0:
                    break
                pts.append((g, r))
            gs = np.array([g for g, _ in pts], dtype=float)
            rs = np.array([r for _, r in pts], dtype=float)
            self._cache[gpu_type] = (gs, rs)
        return self._cache[gpu_type]

    def rate(self, gpu_type: str, g: int) -> float:
        gs, rs = self._points(gpu_type)
        if len(gs) == 0 or g < gs[0] or g > gs[-1]:
            return 0.0
        return float(np.interp(g, gs, rs))

    def max_gpus(self, gpu_type: str) -> int:
        gs, _ = self._points(gpu_type)
        return int(gs[-1]) if len(gs) else 0


@dataclass(frozen=True)
class RingFit:
    """T(g) = a + b/g + c·2(g-1)/g + d·2(g-1): a fixed, b split compute, c = M/B, d = latency."""

    a: float
    b: float
    c: float
    d: float

    def step_time(self, g: np.ndarray | int) -> np.ndarray | float:
        g = np.asarray(g, dtype=float)
        out = self.a + self.b / g + self.c * 2 * (g - 1) / g + self.d * 2 * (g - 1)
        return float(out) if out.ndim == 0 else out


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Small non-negative least squares by elimination of negative coefficients."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if np.all(sol >= 0):
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def fit_ring(gpus: Sequence[int], step_times: Sequence[float], comm_s: float = 0.0,
             latency_term: bool = False) -> RingFit:
    """Fit T(g) = a + b/g + comm_s·2(g-1)/g (+ d·2(g-1)) to measured step times.

    The bandwidth term 2(g-1)/g = 2 - 2/g is a combination of the other two columns, so
    it cannot be told apart from them by step times alone: pass `comm_s` = M/B from the
    model size and link bandwidth (the cost model in `comm`), and the fit finds the
    fixed cost a, the split compute b and, optionally, the per-hop latency d (all >= 0).
    """
    g = np.asarray(gpus, dtype=float)
    y = np.asarray(step_times, dtype=float)
    if g.shape != y.shape or len(g) == 0:
        raise UserError("fit_ring needs as many step times as GPU counts (at least one)")
    if np.any(g < 1) or np.any(y <= 0):
        raise UserError("GPU counts must be >= 1 and step times > 0")
    if comm_s < 0:
        raise UserError(f"comm_s must be >= 0, got {comm_s}")
    resid = y - comm_s * 2 * (g - 1) / g
    cols = [np.ones_like(g), 1.0 / g]
    if latency_term:
        cols.append(2 * (g - 1))
    x = _nnls(np.stack(cols, axis=1), resid)
    return RingFit(float(x[0]), float(x[1]), float(comm_s), float(x[2]) if latency_term else 0.0)


def rate_table(curve: ScalingCurve, gpu_types: Sequence[str], max_g: int) -> np.ndarray:
    """Dense rates[type_index, g] for g = 0..max_g (column 0 is zero)."""
    out = np.zeros((len(gpu_types), max_g + 1))
    for i, t in enumerate(gpu_types):
        top = min(max_g, curve.max_gpus(t))
        for g in range(1, top + 1):
            out[i, g] = curve.rate(t, g)
    return out


def completion_time(remaining: float, rate: float, restart_s: float = 0.0) -> float:
    """Seconds to finish `remaining` work at `rate`, after a restart pause; inf if rate is 0."""
    if rate <= 0:
        return float("inf")
    return restart_s + remaining / rate
